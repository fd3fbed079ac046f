"""A training run killed with SIGKILL at random moments loses nothing but the steps since its
last checkpoint: after every kill each visible checkpoint loads (checksums verified), and
`--resume` carries the run to the end, reaching the same weights as a run never interrupted.

The training runs in a child process forked from a fork server that has tformer's training code
imported already (a trial costs milliseconds instead of seconds of imports), not from the test
process itself: that one may have started thread pools (OpenMP, a peer engine's) in earlier tests,
and a child forked from a process with live thread pools can hang. SIGKILL gives the child no
chance to clean up.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

import tformer
from tformer.checkpoints.format import read_safetensors, resolve
from tformer.cli import main

STEPS = 60
TRIALS = 6  # 3 kills during training, 3 during start-up
TEXT = "Now is the winter of our discontent made glorious summer by this sun of York.\n" * 30


def train_argv(data: Path, out: Path) -> list[str]:
    return ["train", "--data", str(data), "--preset", "tiny", "--context", "16", "--batch-size", "4",
            "--max-steps", str(STEPS), "--save-every", "1", "--log-every", "5", "--eval-every", "1000",
            "--warmup", "1", "--no-progress", "--device", "cpu", "--out", str(out)]


def _child(argv: list[str]) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)           # as the reference run in the test process (conftest.py)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os._exit(main(argv))


def steps_on_disk(run: Path) -> list[int]:
    ckpts = run / "checkpoints"
    return sorted(int(p.name[5:]) for p in ckpts.glob("step-*")) if ckpts.is_dir() else []


def start(argv: list[str]):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tformer.cli", "tformer.training.loop", "tformer.tasks.lm"])
    proc = ctx.Process(target=_child, args=(argv,))
    proc.start()
    return proc


def wait_for_checkpoint_after(run: Path, step: int, proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s > step for s in steps_on_disk(run)):
            return
        assert proc.is_alive(), f"training exited early with code {proc.exitcode}"
        time.sleep(0.005)
    raise AssertionError("no new checkpoint within the timeout")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_sigkill_at_random_moments_then_resume_reaches_the_uninterrupted_result(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    # The same run without interruptions, first: in this process (one thread, like the children), it
    # also imports everything training needs, so the forked children start at once.
    reference = tmp_path / "reference"
    assert main(train_argv(data, reference)) == 0
    run = tmp_path / "run"
    seed = int.from_bytes(os.urandom(4), "little")  # new moments every run; the seed is in any failure
    rng = random.Random(seed)
    seed_note = f"(kill moments from random.Random({seed}))"
    last = 0
    for trial in range(TRIALS):
        argv = train_argv(data, run) if trial == 0 else ["train", "--resume", str(run), "--no-progress"]
        proc = start(argv)
        if trial % 2 == 0:  # somewhere in training: mid-step, mid-save, mid-prune...
            wait_for_checkpoint_after(run, last, proc)
            time.sleep(rng.uniform(0.0, 0.15))
        else:  # somewhere in start-up or the first steps: reading the state, rewriting metrics.jsonl...
            time.sleep(rng.uniform(0.0, 0.2))
        assert proc.is_alive(), f"the run finished before the kill; raise STEPS {seed_note}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        # Every visible checkpoint is complete: config, checksums and weights all load.
        steps = steps_on_disk(run)
        assert steps and steps[-1] >= last, seed_note
        for step in steps:
            tformer.load(run / "checkpoints" / f"step-{step:07d}")
        latest = resolve(run)
        assert latest.name == f"step-{steps[-1]:07d}"
        assert json.loads((latest / "trainer_state.json").read_text())["step"] == steps[-1]
        last = steps[-1]

    proc = start(["train", "--resume", str(run), "--no-progress"])
    proc.join(timeout=120)
    assert proc.exitcode == 0, seed_note
    final = resolve(run)
    assert final.name == f"step-{STEPS:07d}"
    hidden = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not hidden, f"leftovers of killed saves: {hidden}"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in records]
    assert logged == sorted(set(logged)) and logged[-1] == STEPS  # no duplicates, nothing half-written

    got = read_safetensors(final / "model.safetensors")
    want = read_safetensors(resolve(reference) / "model.safetensors")
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=f"{key} differs {seed_note}")


# --- numeric health: a NaN loss or gradient stops the run, and no bad weights reach the disk ----------
def poison(monkeypatch, bad_steps: set[int], where: str) -> None:
    """Make the language-model loss (or only its gradient) non-finite at the given 1-based steps."""
    from tformer.tasks.lm import LMTask

    real = LMTask.loss
    calls = {"n": 0}

    def loss(self, model, batch):
        calls["n"] += 1
        value = real(self, model, batch)
        if calls["n"] in bad_steps:
            if where == "loss":
                return value * float("nan")
            # sqrt at 0: the value stays finite (+0), the gradient is not
            return value + torch.sqrt(next(model.parameters()).sum() * 0)
        return value

    monkeypatch.setattr(LMTask, "loss", loss)


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_nonfinite_step_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys, where):
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    run = tmp_path / "run"
    poison(monkeypatch, {4}, where)
    argv = train_argv(data, run)
    argv[argv.index("--max-steps") + 1] = "8"
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ") and "step 4" in err[-1], err[-1:]
    assert steps_on_disk(run) == [1, 2, 3]  # nothing saved from step 4 on (--keep 3)
    for step in (1, 2, 3):
        model = tformer.load(run / "checkpoints" / f"step-{step:07d}")
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_nonfinite_tolerates_that_many_steps(tmp_path, monkeypatch, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    run = tmp_path / "run"
    poison(monkeypatch, {3, 5}, "loss")
    argv = train_argv(data, run) + ["--skip-nonfinite", "2"]
    argv[argv.index("--max-steps") + 1] = "8"
    assert main(argv) == 0
    final = tformer.load(run)
    assert all(torch.isfinite(p).all() for p in final.parameters())
    assert resolve(run).name == "step-0000008"
    # One more bad step than allowed stops the run.
    poison(monkeypatch, {2, 3, 4}, "loss")
    argv = train_argv(data, tmp_path / "run2") + ["--skip-nonfinite", "2"]
    capsys.readouterr()
    assert main(argv) == 2
    assert "step 4" in capsys.readouterr().err
