"""Classification end to end in miniature: `tformer train --task classify` on an easy synthetic table
learns (held-out accuracy far above chance), then `classify` and `eval` use the run; bad input gives
one-line errors and changes nothing."""

import json
import random

import pytest
import torch

from tformer.cli import main
from tformer.data.files import split_rows

FILLER = "the a film movie story plot actor scene was is it this that and very quite rather".split()


def easy_rows(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Sentences of filler words with one cue word: great/superb -> pos, awful/dreadful -> neg."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["pos", "neg"])
        words = rng.sample(FILLER, 6)
        words.insert(rng.randrange(7), rng.choice(["great", "superb"] if label == "pos" else ["awful", "dreadful"]))
        rows.append((" ".join(words), label))
    return rows


def write_csv(path, rows, header=("text", "label")):
    path.write_text(",".join(header) + "\n" + "".join(f"{t},{label}\n" for t, label in rows), encoding="utf-8")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("classify")
    data = root / "easy.csv"
    write_csv(data, easy_rows(400))
    run = root / "run"
    rc = main(["train", "--task", "classify", "--data", str(data), "--preset", "tiny", "--vocab-size", "300",
               "--max-steps", "120", "--batch-size", "32", "--lr", "3e-3", "--warmup", "10", "--eval-every", "120",
               "--out", str(run), "--no-progress", "--seed", "0"])
    assert rc == 0
    return root, run


def test_pipeline_learns_and_reports(trained, capsys):
    root, run = trained
    assert (run / "confusion.png").is_file()
    assert main(["eval", "--model", str(run), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"val_loss", "accuracy", "macro_f1"}
    assert result["accuracy"] >= 0.9 and result["macro_f1"] >= 0.9  # chance is 0.5


def test_classify_cli_prints_one_line_per_input(trained, capsys, monkeypatch):
    _, run = trained
    long_text = " ".join(["film"] * 400) + " great"
    assert main(["classify", "--model", str(run), "the film was great", "the film was awful", long_text]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert len(lines) == 3
    assert lines[0].split("\t")[0] == "pos" and lines[1].split("\t")[0] == "neg"
    assert all(0.5 <= float(line.split("\t")[1]) <= 1.0 for line in lines)
    assert "warning:" in out.err and "truncated" in out.err
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("a superb film\nan awful film\n"))
    assert main(["classify", "--model", str(run)]) == 0
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == ["pos", "neg"]


def test_classify_cli_rejects_empty_lines(trained, capsys, monkeypatch):
    _, run = trained
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("a superb film\n\nan awful film\n"))
    assert main(["classify", "--model", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "line 2 is empty" in err and "\n" not in err


def test_eval_rejects_labels_the_model_never_saw(trained, tmp_path, capsys):
    _, run = trained
    data = tmp_path / "other.csv"
    write_csv(data, [("a great film", "pos"), ("so so", "meh")])
    assert main(["eval", "--model", str(run), "--data", str(data)]) == 2
    assert "'meh'" in capsys.readouterr().err


def test_train_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    data = tmp_path / "cols.csv"
    write_csv(data, easy_rows(20), header=("review", "sentiment"))
    before = data.read_bytes()
    run = tmp_path / "run"
    assert main(["train", "--task", "classify", "--data", str(data), "--max-steps", "1", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--text-column" in err and err.count("\n") == 1
    assert data.read_bytes() == before and not run.exists()

    rows = easy_rows(50)
    _, val = split_rows(list(range(50)), 0.1, 0)
    rows[val[0]] = ("so so", "meh")  # the only 'meh' lands in the held-out split
    write_csv(data, rows)
    assert main(["train", "--task", "classify", "--data", str(data), "--max-steps", "1", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "'meh'" in err and "never in training" in err and not run.exists()


def test_mean_pooling_is_the_masked_mean_and_survives_save(tmp_path):
    import torch

    import tformer
    from tformer import EncoderClassifier, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(kind="encoder", vocab_size=50, d_model=32, n_heads=4, n_layers=1, max_seq_len=16)
    model = EncoderClassifier(cfg, 3, ["a", "b", "c"], pooling="mean").eval()
    ids = torch.randint(0, 50, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    hidden = model.encoder(ids, mask)
    by_hand = torch.stack([hidden[0].mean(0), hidden[1, :3].mean(0)])
    torch.testing.assert_close(model(ids, mask), model.head(by_hand))
    tformer.save(model, tmp_path / "m")
    again = tformer.load(tmp_path / "m").eval()
    assert again.pooling == "mean"
    torch.testing.assert_close(again(ids, mask), model(ids, mask))


def test_keep_best_is_the_default_and_eval_rescores_the_best_model(tmp_path, capsys):
    """Classification keeps the model of the highest held-out accuracy in RUN/best/; `tformer eval`
    (which loads RUN) recomputes that accuracy from the saved weights."""
    data = tmp_path / "easy.csv"
    write_csv(data, easy_rows(300, seed=1))
    run = tmp_path / "run"
    assert main(["train", "--task", "classify", "--data", str(data), "--preset", "tiny", "--vocab-size", "300",
                 "--max-steps", "30", "--batch-size", "16", "--lr", "3e-3", "--warmup", "5", "--eval-every", "3",
                 "--out", str(run), "--no-progress", "--seed", "0"]) == 0
    capsys.readouterr()
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    accs = [(r["val_accuracy"], -r["step"]) for r in records if "val_accuracy" in r]
    assert len(accs) == 10
    best = json.loads((run / "best" / "config.json").read_text())["meta"]["best"]
    top = max(accs)
    assert best["metric"] == "val_accuracy" and (best["value"], -best["step"]) == top  # the first of ties
    assert main(["eval", "--model", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == pytest.approx(best["value"])


def test_wordpiece_tokenizer_is_uncased_and_a_file_is_used_as_is(tmp_path, capsys):
    from tokenizers import Tokenizer as HFTokenizer

    from tformer.data.tokenizers import make_tokenizer

    texts = [t for t, _ in easy_rows(200)] + ["A great, GREAT film!"]
    wp = make_tokenizer("wordpiece", texts, 200)
    assert (wp.pad_id, wp.bos_id, wp.eos_id) == (0, 1, 2) and wp.kind == "wordpiece"
    assert wp.encode("Great FILM") == wp.encode("great film") and wp.encode("film,") == wp.encode("film ,")
    wp.save(tmp_path / "tokenizer.json")
    reference = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for choice in (str(tmp_path / "tokenizer.json"), str(tmp_path)):
        again = make_tokenizer(choice, [], 0)
        assert again.encode("A superb film!") == reference.encode("A superb film!", add_special_tokens=False).ids
    with pytest.raises(SystemExit) as exit_:  # argparse rejects it: a one-line error, exit 2
        main(["train", "--task", "classify", "--tokenizer", str(tmp_path / "nope.json"), "--max-steps", "1",
              "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "nope.json" in err and "tokenizer.json" in err and not (tmp_path / "run").exists()


def test_freeze_embeddings_keeps_the_pretrained_tables_and_trains_the_rest(trained, tmp_path):
    """--init RUN --freeze-embeddings: the embedding tables come out bit-identical, every other
    weight moves, and the run records the setting."""
    from tformer.checkpoints.format import load

    root, run = trained
    out = tmp_path / "ft"
    assert main(["train", "--task", "classify", "--data", str(root / "easy.csv"), "--init", str(run),
                 "--freeze-embeddings", "--max-steps", "6", "--batch-size", "16", "--eval-every", "6",
                 "--out", str(out), "--no-progress"]) == 0
    before, after = load(run).encoder.state_dict(), load(out / "checkpoints" / "step-0000006").encoder.state_dict()
    for name, t in before.items():
        assert torch.equal(after[name], t) == name.startswith("embed."), name
    assert json.loads((out / "best" / "config.json").read_text())["meta"]["freeze_embeddings"] is True
