"""tformer.training.session: the library call behind `tformer train` does what the command does
(resume merging, the default time budget, the default run directory). Tiny models, a few steps."""

import json
from pathlib import Path

import pytest
import torch

import tformer
from tformer.checkpoints.layout import CHECKPOINTS, RUNS, STATE, step_dirs
from tformer.cli import build_parser, main
from tformer.errors import ConfigError
from tformer.training.config import DEFAULT_TIME_BUDGET, TrainConfig
from tformer.training.loop import fit
from tformer.training.session import prepare, train

TEXT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
        "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n") * 30
SMALL = dict(preset="tiny", context=32, batch_size=8, warmup=2, eval_every=1000, progress=False, precision="fp32",
             dropout=0.0)
FLAGS = ["--preset", "tiny", "--context", "32", "--batch-size", "8", "--warmup", "2", "--eval-every", "1000",
         "--no-progress", "--precision", "fp32", "--dropout", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "play.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


def saved_state(run: Path) -> dict:
    return json.loads((step_dirs(run)[-1] / STATE).read_text(encoding="utf-8"))


def test_library_train_and_resume_match_the_cli(data, tmp_path, capsys):
    """Interrupted at step 3 (--stop-at) and resumed with a changed budget: the library and the CLI
    reach the same step, bit-identical weights and the same saved options."""
    cli, lib = tmp_path / "cli", tmp_path / "lib"
    assert main(["train", "--data", data, *FLAGS, "--max-steps", "6", "--stop-at", "3", "--out", str(cli)]) == 0
    assert main(["train", "--resume", str(cli), "--max-steps", "8"]) == 0
    first = train(data=data, **SMALL, max_steps=6, stop_at=3, out=str(lib))
    assert (first.reason, first.step) == ("stop_at", 3)
    result = train(resume=str(lib), max_steps=8)   # only the resume and what changes: the rest is the saved run's
    assert (result.reason, result.step, Path(result.run_dir)) == ("max_steps", 8, lib)
    a, b = tformer.load(cli).state_dict(), tformer.load(lib).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cli_args, lib_args = saved_state(cli)["args"], saved_state(lib)["args"]
    assert cli_args.pop("out") == str(cli) and lib_args.pop("out") == str(lib)
    assert lib_args == cli_args and lib_args["max_steps"] == 8 and lib_args["stop_at"] is None


def test_library_resume_keeps_the_cli_rules(data, tmp_path):
    """On resume an option that fixes the run (--lr) cannot change, as on the command line; the plan of
    the library equals that of `tformer train --resume`."""
    run = tmp_path / "run"
    train(data=data, **SMALL, max_steps=2, out=str(run))
    with pytest.raises(ConfigError, match="cannot change: --lr"):
        prepare(resume=str(run), lr=0.5)
    lib = prepare(resume=str(run), max_steps=4, stop_at=3)
    cli = prepare_cli(["--resume", str(run), "--max-steps", "4", "--stop-at", "3"])
    assert lib.cfg == cli.cfg and lib.args == cli.args and lib.resume == cli.resume
    assert lib.cfg.max_steps == 4 and lib.cfg.stop_at == 3 and lib.cfg.out == str(run) and lib.chosen == {}
    assert Path(lib.resume).parent.name == CHECKPOINTS


def prepare_cli(argv: list[str]):
    from tformer.cli.train import prepare as cli_prepare

    return cli_prepare(build_parser().parse_args(["train", *argv]))


def test_library_defaults_are_the_clis(data, tmp_path, monkeypatch):
    """No budget: DEFAULT_TIME_BUDGET seconds; no out: runs/<task>-<date>-<time>; both in the library
    plan as in `tformer train`, and in fit() given a TrainConfig without them."""
    monkeypatch.chdir(tmp_path)
    lib, cli = prepare(data=data, **SMALL), prepare_cli(["--data", data, *FLAGS])
    assert lib.cfg.time_budget == cli.cfg.time_budget == DEFAULT_TIME_BUDGET and lib.cfg.max_steps is None
    assert lib.cfg.out.startswith(f"{RUNS}/lm-") and cli.cfg.out.startswith(f"{RUNS}/lm-")
    assert lib.args["time_budget"] == DEFAULT_TIME_BUDGET
    cfg = TrainConfig(out=None, max_steps=2, warmup=1, eval_every=1000, progress=False, precision="fp32")
    result = fit(lib.task, cfg)
    assert result.step == 2 and Path(result.run_dir).parent == Path(RUNS) and Path(result.run_dir).name[:3] == "lm-"
    assert (tmp_path / result.run_dir / CHECKPOINTS).is_dir()


def test_an_unknown_option_is_an_error_and_another_tasks_is_ignored(data):
    with pytest.raises(ConfigError, match="unknown training option.*: lrr"):
        prepare(data=data, **SMALL, lrr=0.1)
    plan = prepare(data=data, **SMALL, max_steps=1, out="unused", max_len=5)  # classify's --max-len, as on the CLI
    assert plan.task.name == "lm" and plan.args["max_len"] == 5
