"""Train / validation / test for every built-in task (issue 50): the three splits never share a text, are
the same for the same seed (the test split for every seed), training and --keep-best read validation
only, and `tformer eval` scores the test split, says so, and gives what a by-hand evaluation of those
items gives. The test split is checked against its definition written out here (tformer.data.splits):
the rows random.Random("test-0") samples, a fixed set whatever the run's seed."""

import json
import random

import pytest
import torch
import torch.nn.functional as F

import tformer
from tformer.checkpoints.format import load_tokenizer
from tformer.checkpoints.layout import resolve
from tformer.cli import main
from tformer.data import corpora
from tformer.data.files import read_text, split_rows
from tformer.data.splits import apart, split_text3, three_way
from tformer.errors import DataError


def builtin(load):
    try:
        return load()
    except DataError as e:   # a corpus whose package is not installed
        pytest.skip(str(e))


def fixed_test_rows(n: int, fraction: float = 0.1) -> list[int]:
    """The test split's definition, by hand: round(fraction * n) rows sampled by random.Random("test-0")."""
    return sorted(random.Random("test-0").sample(range(n), round(fraction * n)))


def train_run(tmp_path, *flags: str):
    run = tmp_path / "run"
    assert main(["train", *flags, "--max-steps", "2", "--eval-every", "1", "--out", str(run), "--no-progress"]) == 0
    return run


def eval_run(capsys, *argv: str) -> tuple[dict, str]:
    """(the JSON figures, the line saying what was scored) of `tformer eval ... --json`."""
    capsys.readouterr()
    assert main(["eval", *argv, "--json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err.strip()


class Spy:
    """Wraps a scoring function: records the first argument of its kind (texts, ids) at every call."""

    def __init__(self, fn, pick):
        self.fn, self.pick, self.seen = fn, pick, []

    def __call__(self, *args, **kwargs):
        self.seen.append(self.pick(args))
        return self.fn(*args, **kwargs)


def forbid_test(monkeypatch, cls):
    """Training must never rebuild the test split: the task's heldout (what eval reads) raises."""
    def refuse(*args, **kwargs):
        raise AssertionError("the test split was read during training")
    monkeypatch.setattr(cls, "heldout", classmethod(refuse))


# --- the splits themselves ----------------------------------------------------------------------

def test_three_way_is_disjoint_deterministic_and_tests_the_same_rows_for_every_seed():
    units = list(range(1000))
    a = three_way(units, 0.1, 0.2, seed=3)
    assert a == three_way(units, 0.1, 0.2, seed=3)
    assert sorted(a["train"] + a["validation"] + a["test"]) == units
    assert (len(a["validation"]), len(a["test"])) == (100, 200)
    assert a["test"] == fixed_test_rows(1000, 0.2)
    b = three_way(units, 0.1, 0.2, seed=4)
    assert b["test"] == a["test"] and b["validation"] != a["validation"]
    assert not set(b["validation"]) & set(b["test"])
    no_test = three_way(units, 0.1, 0.0, seed=3)                   # no test split: the two-way split, unchanged
    assert (no_test["train"], no_test["validation"], no_test["test"]) == (*split_rows(units, 0.1, 3), [])
    with pytest.raises(DataError, match="too few"):
        three_way([1, 2], 0.1, 0.1, seed=0)
    with pytest.raises(DataError, match="test fraction"):
        three_way(units, 0.5, 0.5, seed=0)


def test_a_repeated_text_is_scored_only_where_it_was_never_trained_on():
    texts = ["a", "b", "a", "c", "b", "d"]
    rows = apart({"train": [0, 5], "validation": [1, 2], "test": [4]}, texts.__getitem__)
    assert rows == {"test": [4], "validation": [2], "train": [5]}   # "b" stays in test, "a" in validation


def test_rotten_tomatoes_splits_share_no_text():
    from tformer.tasks.classify import ClassifyTask, splits
    data = builtin(corpora.rotten_tomatoes)
    rows = splits(data, 0.1, 0.1, seed=0)
    assert rows == splits(data, 0.1, 0.1, seed=0)
    text = {name: {data.texts[i] for i in r} for name, r in rows.items()}
    assert not text["test"] & (text["train"] | text["validation"]) and not text["validation"] & text["train"]
    assert rows["test"] == fixed_test_rows(len(data.texts))
    other = splits(data, 0.1, 0.1, seed=1)
    assert other["test"] == rows["test"] and other["validation"] != rows["validation"]
    meta = {"heldout": {"data": "rotten-tomatoes", "val_fraction": 0.1, "test_fraction": 0.1, "test_seed": 0,
                        "seed": 0}}
    for name in ("validation", "test"):   # what eval rebuilds from a run's meta
        assert ClassifyTask.heldout(meta, split=name)[0] == [data.texts[i] for i in rows[name]]


def test_wnut16_splits_share_no_tweet():
    from tformer.tasks.tag import splits
    data = builtin(corpora.wnut16)
    rows = splits(data, 0.1, 0.1, seed=0)
    tweets = {name: {tuple(data.words[i]) for i in r} for name, r in rows.items()}
    assert not tweets["test"] & (tweets["train"] | tweets["validation"]) and not tweets["validation"] & tweets["train"]
    assert rows["test"] == fixed_test_rows(len(data.words)) and rows == splits(data, 0.1, 0.1, seed=0)
    assert splits(data, 0.1, 0.1, seed=2)["test"] == rows["test"]


def test_bible_splits_hold_out_whole_chapters_and_share_no_verse():
    from tformer.data import bible
    from tformer.tasks.translate import load_splits
    if not (bible.cache_root() / "bible-en-es.tsv").exists():
        pytest.skip("bible-en-es not built yet (`make system-deps`)")
    pairs = corpora.bible_en_es()
    held, _ = load_splits("bible-en-es", 0.1, 0.1, seed=0)
    chapters = sorted(set(pairs.groups))
    tested = {chapters[i] for i in fixed_test_rows(len(chapters))}
    verses = list(zip(pairs.sources, pairs.targets, pairs.groups))
    assert held["test"] == ([s for s, _, g in verses if g in tested], [t for _, t, g in verses if g in tested])
    assert set(zip(*held["validation"])) <= {(s, t) for s, t, g in verses if g not in tested}
    source = {name: set(pair[0]) for name, pair in held.items()}
    assert not source["test"] & (source["train"] | source["validation"]) and not source["validation"] & source["train"]
    assert load_splits("bible-en-es", 0.1, 0.1, seed=1)[0]["test"] == held["test"]


def test_numbers_splits_are_disjoint_and_never_trained_on():
    from tformer.tasks.translate import load_splits
    builtin(lambda: corpora.number_pair(1))
    held, numbers = load_splits("numbers-fr-en", 0.1, 0.1, seed=0, heldout_numbers=300)
    test = sorted(random.Random("numbers-test-0").sample(range(10**6), 300))
    assert held["test"][0] == [corpora.number_pair(n)[0] for n in test]
    assert len(held["validation"][0]) == 300 and not set(held["validation"][0]) & set(held["test"][0])
    rng = random.Random(0)
    assert not {corpora.sample_training_number(rng, numbers) for _ in range(20000)} & numbers


def test_hamlet_is_cut_in_three_consecutive_parts_the_last_tenth_testing():
    text = read_text("hamlet")
    parts = split_text3(text, 0.1, 0.1)
    assert parts["train"] + parts["validation"] + parts["test"] == text
    assert parts["test"] == text[int(len(text) * 0.9):]
    assert abs(len(parts["validation"]) - len(text) / 10) <= 1


# --- training reads validation only; `tformer eval` scores the test split ---------------------------

def test_classify_on_rotten_tomatoes(tmp_path, capsys, monkeypatch):
    from tformer.tasks import classify
    data = builtin(corpora.rotten_tomatoes)
    spy = Spy(classify.score, lambda a: a[2])
    monkeypatch.setattr(classify, "score", spy)
    forbid_test(monkeypatch, classify.ClassifyTask)
    run = train_run(tmp_path, "--task", "classify", "--preset", "tiny", "--batch-size", "8", "--keep-best")
    monkeypatch.undo()
    test = fixed_test_rows(len(data.texts))
    val = set(classify.splits(data, 0.1, 0.1, seed=0)["validation"])
    assert spy.seen and all(texts == [data.texts[i] for i in sorted(val)] for texts in spy.seen)
    assert not {t for texts in spy.seen for t in texts} & {data.texts[i] for i in test}

    result, said = eval_run(capsys, "--model", str(run))
    assert said == f"split: test ({len(test):,} texts, never used in training)"
    model, tokenizer = tformer.load(run).eval(), load_tokenizer(run)
    max_len = json.loads((resolve(run) / "config.json").read_text())["meta"]["max_len"]
    labels = model.labels
    losses, right = [], 0
    with torch.no_grad():
        for i in test:   # one text at a time: no padding
            ids = [tokenizer.bos_id] + tokenizer.encode(data.texts[i])[:max_len - 2] + [tokenizer.eos_id]
            logits = model(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
            gold = labels.index(data.labels[i])
            losses.append(F.cross_entropy(logits[None], torch.tensor([gold])).item())
            right += int(logits.argmax()) == gold
    assert result["accuracy"] == pytest.approx(right / len(test), abs=1e-9)
    assert result["val_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4)
    validation, said = eval_run(capsys, "--model", str(run), "--split", "validation")
    assert said.startswith(f"split: validation ({len(val):,} texts, the run validated on them")
    best = json.loads((run / "best" / "config.json").read_text())["meta"]["best"]
    assert validation["accuracy"] == pytest.approx(best["value"])   # --keep-best chose on validation


def test_lm_on_hamlet(tmp_path, capsys, monkeypatch):
    from tformer.tasks import lm
    spy = Spy(lm.mean_loss, lambda a: len(a[1]))
    monkeypatch.setattr(lm, "mean_loss", spy)
    forbid_test(monkeypatch, lm.LMTask)
    run = train_run(tmp_path, "--data", "hamlet", "--preset", "tiny", "--context", "64", "--batch-size", "4")
    monkeypatch.undo()
    tokenizer = load_tokenizer(run)
    parts = split_text3(read_text("hamlet"), 0.1, 0.1)
    assert spy.seen and set(spy.seen) == {len(tokenizer.encode(parts["validation"]))}

    result, said = eval_run(capsys, "--model", str(run))
    ids = torch.tensor(tokenizer.encode(parts["test"]))
    assert said == f"split: test ({len(ids):,} tokens, never used in training)"
    model = tformer.load(run).eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 64):   # consecutive windows: every test token predicted once
            x, y = ids[start:start + 64], ids[start + 1:start + 65]
            total += F.cross_entropy(model(x[None, :len(y)])[0], y, reduction="sum").item()
    assert result["val_loss"] == pytest.approx(total / (len(ids) - 1), rel=1e-4)


def test_translate_on_numbers(tmp_path, capsys, monkeypatch):
    from tformer.tasks import translate
    builtin(lambda: corpora.number_pair(1))
    spy = Spy(translate.score, lambda a: a[2])
    monkeypatch.setattr(translate, "score", spy)
    forbid_test(monkeypatch, translate.TranslateTask)
    run = train_run(tmp_path, "--task", "translate", "--preset", "tiny", "--vocab-size", "300", "--batch-size", "8",
                    "--heldout-numbers", "40")
    monkeypatch.undo()
    test = [corpora.number_pair(n) for n in sorted(random.Random("numbers-test-0").sample(range(10**6), 40))]
    val = [corpora.number_pair(n)[0] for n in corpora.numbers_heldout(40, 0)]
    assert spy.seen and all(sources == val for sources in spy.seen)
    assert not {s for sources in spy.seen for s in sources} & {fr for fr, _ in test}

    result, said = eval_run(capsys, "--model", str(run), "--limit", "10")
    assert said == "split: test (the first 10 of 40 pairs, never used in training)"
    model, tokenizer = tformer.load(run).eval(), load_tokenizer(run)
    total, count = 0.0, 0
    with torch.no_grad():
        for fr, en in test[:10]:
            src = torch.tensor([tokenizer.encode(fr) + [tokenizer.eos_id]])
            tgt = tokenizer.encode(en)
            logits = model(src, torch.tensor([[tokenizer.bos_id] + tgt]), torch.ones_like(src))[0]
            total += F.cross_entropy(logits, torch.tensor(tgt + [tokenizer.eos_id]), reduction="sum").item()
            count += len(tgt) + 1
    assert result["val_loss"] == pytest.approx(total / count, rel=1e-4)


def test_tag_on_wnut16(tmp_path, capsys, monkeypatch):
    pytest.importorskip("seqeval")
    from seqeval.metrics import f1_score

    from tformer.evaluation.tag import predict_tags
    from tformer.tasks import tag
    data = builtin(corpora.wnut16)
    spy = Spy(tag.score, lambda a: a[2])
    monkeypatch.setattr(tag, "score", spy)
    forbid_test(monkeypatch, tag.TagTask)
    run = train_run(tmp_path, "--task", "tag", "--preset", "tiny", "--vocab-size", "300", "--batch-size", "8")
    monkeypatch.undo()
    test = fixed_test_rows(len(data.words))
    assert spy.seen and not {tuple(w) for words in spy.seen for w in words} & {tuple(data.words[i]) for i in test}

    result, said = eval_run(capsys, "--model", str(run))
    assert said == f"split: test ({len(test):,} sentences, never used in training)"
    model, tokenizer = tformer.load(run).eval(), load_tokenizer(run)
    max_len = json.loads((resolve(run) / "config.json").read_text())["meta"]["max_len"]
    predicted = predict_tags(model, tokenizer, [data.words[i] for i in test], max_len)
    assert result["f1"] == pytest.approx(f1_score([data.labels[i] for i in test], predicted), abs=1e-9)


# --- a user's file; a run from before test splits ------------------------------------------------

def write_rows(path, n: int) -> list[tuple[str, str]]:
    rng = random.Random(0)
    rows = [(f"{' '.join(rng.choices('abcdefgh', k=5))} {label}", label) for label in rng.choices(["x", "y"], k=n)]
    path.write_text("text,label\n" + "".join(f"{t},{label}\n" for t, label in rows), encoding="utf-8")
    return rows


def test_a_users_file_has_a_test_split_only_when_asked(tmp_path, capsys):
    data = tmp_path / "rows.csv"
    write_rows(data, 200)
    flags = ["--task", "classify", "--data", str(data), "--preset", "tiny", "--vocab-size", "100", "--batch-size", "8"]
    run = train_run(tmp_path, *flags)
    _, said = eval_run(capsys, "--model", str(run))
    assert said.startswith("split: validation (20 texts, the run validated on them")
    capsys.readouterr()
    assert main(["eval", "--model", str(run), "--split", "test"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "no test split" in err and err.count("\n") == 1

    run = train_run(tmp_path / "three", *flags, "--test-fraction", "0.2")
    result, said = eval_run(capsys, "--model", str(run))
    assert said == "split: test (40 texts, never used in training)"


def test_a_run_from_before_test_splits_scores_its_one_heldout_split_and_says_so(tmp_path, capsys):
    data = tmp_path / "rows.csv"
    rows = write_rows(data, 200)
    run = train_run(tmp_path, "--task", "classify", "--data", str(data), "--preset", "tiny", "--vocab-size", "100",
                    "--batch-size", "8", "--test-fraction", "0.2")
    config = resolve(run) / "config.json"
    saved = json.loads(config.read_text())
    for key in ("test_fraction", "test_seed"):   # what a run's meta held before test splits
        del saved["meta"]["heldout"][key]
    config.write_text(json.dumps(saved))
    old, said = eval_run(capsys, "--model", str(run))
    assert said.startswith("split: held-out (20 texts, this run is from before tformer kept a test split apart")
    held = split_rows(list(range(len(rows))), 0.1, 0)[1]   # the held-out rows as before: a seeded 10%
    texts = [rows[i][0] for i in held]
    from tformer.evaluation.classify import score
    model = tformer.load(run).eval()
    labels = [model.labels.index(rows[i][1]) for i in held]
    expected = score(model, load_tokenizer(run), texts, labels, saved["meta"]["max_len"], model.labels)
    assert old["accuracy"] == pytest.approx(expected["accuracy"]) and old["val_loss"] == pytest.approx(
        expected["val_loss"])
    capsys.readouterr()
    assert main(["eval", "--model", str(run), "--split", "test"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "before tformer kept a test split apart" in err
