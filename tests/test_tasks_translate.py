"""Translation end to end in miniature: an EncoderDecoder learns a tiny numbers table through
`tformer train --task translate`; `translate` / `eval` use the run; the built-in numbers data is a
pure function of (seed, step) and never shows a held-out number; bad input gives one-line errors."""

import argparse
import json

import pytest

from tformer import corpora
from tformer.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("translate")
    data = root / "numbers.tsv"
    data.write_text("".join("\t".join(corpora.number_pair(n)) + "\n" for n in range(1, 31)), encoding="utf-8")
    run = root / "run"
    rc = main(["train", "--task", "translate", "--data", str(data), "--preset", "tiny", "--vocab-size", "300",
               "--max-steps", "150", "--batch-size", "32", "--lr", "3e-3", "--warmup", "10", "--eval-every", "150",
               "--val-fraction", "0.1", "--label-smoothing", "0.0", "--out", str(run), "--no-progress"])
    assert rc == 0
    return data, run


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
    from tformer.tasks.translate import TranslateTask

    args = argparse.Namespace(data="numbers-fr-en", preset="tiny", vocab_size=400, batch_size=16, seed=0,
                              val_fraction=0.1, heldout_numbers=200, dropout=None)
    task = TranslateTask(args)
    held_fr = set(task.val[0])
    assert len(held_fr) == 200
    assert [corpora.number_pair(n)[0] for n in corpora.numbers_heldout(200, 0)] == task.val[0]
    a, b = task.batch(7), task.batch(7)
    assert all((a[k] == b[k]).all() for k in a)
    for step in range(20):
        sources = [task.tokenizer.decode(row) for row in task.batch(step)["src_ids"]]
        assert not held_fr & {s.strip() for s in sources}
    assert task.tokenizer.decode(task.tokenizer.encode("quatre-vingt-dix-sept")) == "quatre-vingt-dix-sept"
