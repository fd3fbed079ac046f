"""Translation end to end in miniature: an EncoderDecoder learns a tiny numbers table through
`tformer train --task translate`; `translate` / `eval` use the run; the built-in numbers data is a
pure function of (seed, step) and never shows a held-out number; bad input gives one-line errors."""

import json

import pytest

from tformer.cli import main
from tformer.data import corpora


def miniature_run(root, *extra: str) -> list[str]:
    """Writes 30 number pairs to root/numbers.tsv; the flags of a 150-step tiny translate run on them."""
    data = root / "numbers.tsv"
    data.write_text("".join("\t".join(corpora.number_pair(n)) + "\n" for n in range(1, 31)), encoding="utf-8")
    return ["train", "--task", "translate", "--data", str(data), "--preset", "tiny", "--vocab-size", "300", *extra,
            "--max-steps", "150", "--batch-size", "32", "--lr", "3e-3", "--warmup", "10", "--eval-every", "150",
            "--val-fraction", "0.1", "--label-smoothing", "0.0", "--out", str(root / "run"), "--no-progress"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("translate")
    run = root / "run"
    rc = main(miniature_run(root))
    assert rc == 0
    return root / "numbers.tsv", run


def test_pipeline_learns_the_training_pairs(trained, capsys):
    data, run = trained
    assert main(["eval", "--model", str(run), "--data", str(data), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"val_loss", "perplexity", "bleu", "chrf", "exact_match"}
    assert result["exact_match"] >= 0.9  # memorising 27 training pairs (3 are held out) is easy


def test_translate_cli(trained, capsys, monkeypatch):
    _, run = trained
    assert main(["translate", "--model", str(run), "--num-beams", "2", "dix-sept", "vingt et un"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.strip() for line in lines)
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("deux\ntrois\nquatre\n"))
    assert main(["translate", "--model", str(run), "--num-beams", "1"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    monkeypatch.setattr("sys.stdin", io.StringIO("deux\n\nquatre\n"))
    assert main(["translate", "--model", str(run)]) == 2
    assert "line 2 is empty" in capsys.readouterr().err


def test_tsv_without_tab_is_an_error(tmp_path, capsys):
    data = tmp_path / "bad.tsv"
    data.write_text("un\tone\ndeux two\n", encoding="utf-8")
    run = tmp_path / "run"
    assert main(["train", "--task", "translate", "--data", str(data), "--max-steps", "1", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "bad.tsv:2" in err and "tab" in err and not run.exists()


def test_numbers_batches_are_pure_and_avoid_heldout():
    from tformer.tasks.translate import TranslateOptions, TranslateTask

    opts = TranslateOptions(out="unused", data="numbers-fr-en", preset="tiny", vocab_size=400, batch_size=16, seed=0,
                            val_fraction=0.1, heldout_numbers=200, dropout=None)
    task = TranslateTask(opts)
    held_fr = set(task.val[0])
    assert len(held_fr) == 200
    assert [corpora.number_pair(n)[0] for n in corpora.numbers_heldout(200, 0)] == task.val[0]
    a, b = task.batch(7), task.batch(7)
    assert all((a[k] == b[k]).all() for k in a)
    for step in range(20):
        sources = [task.tokenizer.decode(row) for row in task.batch(step)["src_ids"]]
        assert not held_fr & {s.strip() for s in sources}
    assert task.tokenizer.decode(task.tokenizer.encode("quatre-vingt-dix-sept")) == "quatre-vingt-dix-sept"


# --- separate source and target vocabularies (--separate-vocab) -----------------------------------

@pytest.fixture(scope="module")
def trained_separate(tmp_path_factory):
    """The same miniature run with one BPE vocabulary per language, interrupted at step 100 and resumed."""
    root = tmp_path_factory.mktemp("translate-separate")
    run = root / "run"
    flags = miniature_run(root, "--separate-vocab")
    assert main(flags + ["--stop-at", "100"]) == 0
    first = (run / "checkpoints" / "step-0000100" / "source_tokenizer.json").read_bytes()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    return root / "numbers.tsv", run, first


def test_separate_vocabularies_are_saved_and_each_fits_its_language(trained_separate):
    from tformer.checkpoints.format import load_source_tokenizer, load_tokenizer, read_config, resolve

    data, run, first = trained_separate
    ckpt = resolve(run)
    assert ckpt.name == "step-0000150" and (ckpt / "source_tokenizer.json").read_bytes() == first  # resumed as is
    source, target = load_source_tokenizer(run), load_tokenizer(run)
    config = read_config(run)
    assert config["meta"]["separate_vocab"] is True
    saved = config["config"]
    assert (saved["src_vocab_size"], saved["vocab_size"]) == (source.vocab_size, target.vocab_size)
    pairs = [line.split("\t") for line in data.read_text(encoding="utf-8").splitlines()]
    french, english = [p[0] for p in pairs], [p[1] for p in pairs]

    def tokens(tokenizer, texts):
        return sum(len(ids) for ids in tokenizer.encode_batch(texts))

    assert tokens(source, french) < tokens(target, french)      # a vocabulary learned on French reads French ...
    assert tokens(target, english) < tokens(source, english)    # ... in fewer pieces, and the English one English


def test_separate_vocabularies_learn_translate_and_eval(trained_separate, capsys, monkeypatch):
    import io
    import math

    data, run, _ = trained_separate
    assert main(["eval", "--model", str(run), "--data", str(data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["exact_match"] >= 0.9     # as the shared-vocabulary run
    assert main(["eval", "--model", str(run), "--json"]) == 0             # the run's own held-out pairs
    held = json.loads(capsys.readouterr().out)
    assert set(held) == {"val_loss", "perplexity", "bleu", "chrf", "exact_match"} and math.isfinite(held["val_loss"])
    pairs = [line.split("\t") for line in data.read_text(encoding="utf-8").splitlines()]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(p[0] + "\n" for p in pairs)))
    assert main(["translate", "--model", str(run), "--num-beams", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(pairs) and sum(out == p[1] for out, p in zip(lines, pairs)) >= 0.8 * len(pairs)


def test_separate_vocabularies_in_trace_and_attention(trained_separate, capsys):
    from tformer.checkpoints.format import load, load_source_tokenizer, load_tokenizer
    from tformer.inspect.trace import attention_maps, prepare, token_label

    _, run, _ = trained_separate
    source, target = load_source_tokenizer(run), load_tokenizer(run)
    labels = [token_label(source, i) for i in source.encode("vingt et un")]
    assert labels != [token_label(target, i) for i in target.encode("vingt et un")]  # the two really differ
    assert main(["trace", "--model", str(run), "--text", "vingt et un"]) == 0
    assert "input: " + " ".join(map(repr, labels)) in capsys.readouterr().out.splitlines()
    model = load(run)
    maps = attention_maps(model, prepare(model, target, "vingt et un", source_tokenizer=source))
    cross = next(m for m in maps if m.name == "cross-attention")
    assert cross.key_tokens == labels                                    # the source, read with its own vocabulary


def test_separate_vocabulary_model_is_not_exported_to_hf(trained_separate, tmp_path, capsys):
    _, run, _ = trained_separate
    assert main(["export-hf", str(run), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert "src_vocab_size" in err and "shared" in err and not (tmp_path / "hf").exists()
