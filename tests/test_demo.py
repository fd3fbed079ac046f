"""`make demo` end to end, with a 3-second budget: it trains, reports the best validation loss it
recorded, writes samples from the best (averaged) weights, and leaves a run `tformer generate` reads."""

import json
import subprocess
import sys


def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "tformer.cli.demo", "--time-budget", "3", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    best = min(rec["val_loss"] for rec in records if "val_loss" in rec)
    assert f"best validation loss {best:.4f}" in r.stdout
    assert r.stdout.count("--- sample (") == 3 and "HAMLET:" in r.stdout
    assert (out / "best" / "model.safetensors").is_file() and (out / "loss.png").is_file()
    assert f"tformer generate --model {out}" in r.stdout
