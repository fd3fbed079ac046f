"""tformer's own T5-style models: the t5-small preset's choices train through `tformer train --task
translate --preset t5-small` (its shape shrunk here, so the test takes seconds), and the trained run
translates, saves and reloads; the relative bias shows in `tformer trace`."""

import json

from tformer import PRESETS, corpora
from tformer.checkpoint import load
from tformer.cli import main

SHRUNK = dict(d_model=32, n_heads=3, head_size=8, n_layers=2, n_decoder_layers=1, d_ff=48, max_seq_len=64,
              dropout=0.0, ffn_dropout=0.0)


def test_t5_preset_trains_on_translation(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(PRESETS, "t5-small", {**PRESETS["t5-small"], **SHRUNK})
    data = tmp_path / "numbers.tsv"
    data.write_text("".join("\t".join(corpora.number_pair(n)) + "\n" for n in range(1, 31)), encoding="utf-8")
    run = tmp_path / "run"
    assert main(["train", "--task", "translate", "--data", str(data), "--preset", "t5-small", "--vocab-size", "300",
                 "--max-steps", "20", "--batch-size", "16", "--lr", "3e-3", "--warmup", "5", "--eval-every", "10",
                 "--eval-sentences", "2", "--val-fraction", "0.1", "--precision", "fp32", "--out", str(run),
                 "--no-progress"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0]
    model = load(run)
    assert (model.cfg.positional, model.cfg.attention_scale, model.cfg.norm) == ("relative", False, "rmsnorm")
    capsys.readouterr()
    assert main(["translate", "--model", str(run), "--num-beams", "2", "vingt et un"]) == 0
    assert capsys.readouterr().out.strip()
