"""`tformer eval` on a language model: without --data it rebuilds the run's own validation split, so
it must reproduce the validation loss the trainer logged for the same weights."""

import json
import math

from tformer.cli import main


def test_eval_lm_reproduces_the_runs_validation_loss(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("to be or not to be, that is the question.\n" * 60, encoding="utf-8")
    run = tmp_path / "run"
    assert main(["train", "--data", str(text), "--preset", "tiny", "--context", "32", "--max-steps", "3",
                 "--eval-every", "3", "--out", str(run), "--no-progress"]) == 0
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r["val_loss"] for r in logged if "val_loss" in r][-1]
    capsys.readouterr()
    assert main(["eval", "--model", str(run), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"val_loss", "perplexity"}
    assert math.isclose(result["val_loss"], logged, rel_tol=1e-5)
    assert math.isclose(result["perplexity"], math.exp(logged), rel_tol=1e-5)


def test_eval_refuses_a_bare_encoder(tmp_path, capsys):
    import tformer

    cfg = tformer.ModelConfig(kind="encoder", vocab_size=10, d_model=16, n_heads=2, n_layers=1)
    tformer.save(tformer.Encoder(cfg), tmp_path / "enc")
    assert main(["eval", "--model", str(tmp_path / "enc")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "bare Encoder" in err and err.count("\n") == 1
