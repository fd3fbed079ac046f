"""SFT and DPO runs end to end: DPO's rewards/* logged per step (recomputed by hand with trl's formula from the
step's checkpoint), `tformer eval` of SFT and DPO runs (LoRA ones through base + adapter), --init from a LoRA
run (base + adapter merged; an int8 one refused), and both tasks with LoRA under torchrun (2 processes, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tformer
from chat_util import NUMBERS, save_base, write_jsonl
from tformer.checkpoints.format import load_tokenizer
from tformer.checkpoints.layout import checkpoint_dir, resolve
from tformer.cli import build_parser, main
from tformer.data.chat import Renderer, read_examples
from tformer.data.chat_template import find_chat_template
from tformer.data.files import split_rows
from tformer.model.lora import lora_layers, lora_state_dict
from tformer.tasks.dpo import read_pairs
from tformer.training.dpo import REWARD_METRICS
from tformer.training.loop import Trainer
from tformer.training.steplog import postfix

BETA = 0.5
COMMON = ["--batch-size", "8", "--warmup", "0", "--no-progress", "--precision", "fp32", "--log-every", "1",
          "--val-fraction", "0.25"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1] / "src")}


def question(i: int) -> str:
    return f"what is {NUMBERS[i % 9]} plus {NUMBERS[(i // 9) % 9]}?"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_base(tmp_path_factory.mktemp("chat") / "base")


@pytest.fixture(scope="module")
def prefs(tmp_path_factory) -> Path:
    pairs = [{"prompt": question(i) if i % 2 else [{"role": "user", "content": question(i)}],
              "chosen": " yes", "rejected": " no" if i % 3 else " maybe"} for i in range(40)]
    return write_jsonl(tmp_path_factory.mktemp("prefs") / "pairs.jsonl", pairs)


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    rows = [{"messages": [{"role": "user", "content": question(i)}, {"role": "assistant", "content": NUMBERS[i % 9]}]}
            for i in range(32)]
    return write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", rows)


def run(argv: list[str]):
    """`tformer train ARGV` in this process: (the Trainer, holding its task and model, FitResult)."""
    from tformer.cli.train import prepare

    task, cfg, resume, saved, _ = prepare(build_parser().parse_args(["train", *argv]))
    trainer = Trainer(task, cfg, args=saved)
    return trainer, trainer.run(resume)


@pytest.fixture(scope="module")
def dpo_full(base, prefs, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "run"
    return run(["--task", "dpo", "--init", str(base), "--data", str(prefs), *COMMON, "--dpo-beta", str(BETA),
                "--grad-accum", "2", "--lr", "3e-3", "--max-steps", "4", "--eval-every", "4", "--save-every", "1",
                "--keep", "10", "--out", str(out)])


@pytest.fixture(scope="module")
def dpo_lora(base, prefs, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo-lora") / "run"
    return run(["--task", "dpo", "--init", str(base), "--data", str(prefs), *COMMON, "--dpo-beta", str(BETA),
                "--lr", "1e-2", "--lora-r", "2", "--lora-dropout", "0", "--lora-targets", "q,v,o", "--max-steps", "4",
                "--eval-every", "4", "--out", str(out)])


@pytest.fixture(scope="module")
def sft_lora(base, chats, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft-lora") / "run"
    return run(["--task", "sft", "--init", str(base), "--data", str(chats), *COMMON, "--lr", "1e-2",
                "--lora-r", "2", "--lora-dropout", "0", "--lora-targets", "q,v,o,up,down", "--max-steps", "4",
                "--eval-every", "4", "--out", str(out)])


# --- by hand: log-probabilities of the trained tokens of one unpadded sequence ----------------------
def logp(model, ids: list[int], trained: list[bool]) -> float:
    """sum over t >= 1 where trained[t] of log p(ids[t] | ids[:t]), in float64 from the model's logits."""
    with torch.no_grad():
        logits = model.eval()(torch.tensor([ids]))[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[t - 1, ids[t]]) for t in range(1, len(ids)) if trained[t])


def rows_of(batch: dict, side: str) -> list[tuple[list[int], list[bool]]]:
    """The unpadded (ids, trained) of each row of a collated side of a DPO batch."""
    out = []
    for ids, mask, response in zip(batch[f"{side}_ids"], batch[f"{side}_mask"], batch[f"{side}_response"]):
        n = int(mask.sum())
        out.append((ids[:n].tolist(), response[:n].bool().tolist()))
    return out


def trl_rewards(policy, reference, chosen: list, rejected: list) -> dict[str, float]:
    """trl's sigmoid-DPO metrics: rewards = beta * (policy logp - reference logp), per side; their batch means,
    the mean margin, the share of pairs whose chosen reward is the higher; and the loss."""
    c = torch.tensor([BETA * (logp(policy, *r) - logp(reference, *r)) for r in chosen])
    r = torch.tensor([BETA * (logp(policy, *x) - logp(reference, *x)) for x in rejected])
    return {"rewards/chosen": float(c.mean()), "rewards/rejected": float(r.mean()),
            "rewards/margins": float((c - r).mean()), "rewards/accuracies": float((c > r).double().mean()),
            "loss": float(-F.logsigmoid(c - r).mean())}


def test_dpo_logs_trls_rewards_for_each_step(dpo_full, base):
    trainer, result = dpo_full
    steps = [r for r in result.records if "train_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    logged = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert all(set(REWARD_METRICS) <= set(r) for r in logged if "train_loss" in r)     # the file holds them
    reference = tformer.load(base)
    for record in steps:                        # step k's update started from checkpoint k-1 (0: --init) on batch k-1
        k = record["step"]
        before = tformer.load(checkpoint_dir(Path(result.run_dir), k - 1) if k > 1 else base)
        batch = trainer.task.batch(k - 1)
        expected = trl_rewards(before, reference, rows_of(batch, "chosen"), rows_of(batch, "rejected"))
        for name in REWARD_METRICS:
            assert abs(record[name] - expected[name]) <= 1e-5, (k, name, record[name], expected[name])
        assert abs(record["train_loss"] - expected["loss"]) <= 1e-5
    assert steps[-1]["rewards/margins"] > 0 and steps[-1]["rewards/accuracies"] > 0.5    # it learned something
    assert postfix(steps[-1])["margins"] == f"{steps[-1]['rewards/margins']:.3g}"        # and the progress bar


def eval_json(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main(["eval", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def dpo_by_hand(policy, reference, model_dir, pairs) -> dict[str, float]:
    renderer = Renderer(load_tokenizer(model_dir), find_chat_template(resolve(model_dir)))
    sides = [[renderer(getattr(p, side)) for p in pairs] for side in ("chosen", "rejected")]
    return trl_rewards(policy, reference, *[[(r.ids, r.trained) for r in side] for side in sides])


@pytest.mark.parametrize("which", ["full", "lora"])
def test_eval_of_a_dpo_run_scores_its_heldout_pairs_against_its_reference(which, dpo_full, dpo_lora, base, prefs,
                                                                          capsys, tmp_path):
    _, result = dpo_full if which == "full" else dpo_lora
    got = eval_json(capsys, "--model", result.run_dir)
    policy = tformer.load(result.run_dir)
    assert bool(lora_layers(policy)) == (which == "lora")            # a LoRA run loads as base + adapter
    heldout = split_rows(read_pairs(prefs), 0.25, 0)[1]
    expected = dpo_by_hand(policy, tformer.load(base), result.run_dir, heldout)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(got[name] - expected[name]) <= 1e-5, name
    assert got["accuracy"] == pytest.approx(expected["rewards/accuracies"], abs=1e-9)
    assert abs(got["val_loss"] - expected["loss"]) <= 1e-5
    last = [r for r in result.records if "val_accuracy" in r][-1]     # what training's validation said
    assert got["accuracy"] == pytest.approx(last["val_accuracy"]) and got["val_loss"] == pytest.approx(last["val_loss"])
    some = write_jsonl(tmp_path / "some.jsonl", [{"prompt": question(i), "chosen": " yes", "rejected": " no"}
                                                for i in range(3)])
    got = eval_json(capsys, "--model", result.run_dir, "--data", str(some))    # --data: a file scored whole
    expected = dpo_by_hand(policy, tformer.load(base), result.run_dir, read_pairs(some))
    assert abs(got["rewards/margins"] - expected["rewards/margins"]) <= 1e-5


def sft_by_hand(model, model_dir, examples) -> float:
    """The mean cross-entropy over the trained tokens of every example, each alone."""
    renderer = Renderer(load_tokenizer(model_dir), find_chat_template(resolve(model_dir)))
    total, count = 0.0, 0
    for r in map(renderer, examples):
        total -= logp(model, r.ids, r.trained)
        count += sum(r.trained[1:])
    return total / count


def test_eval_of_an_sft_lora_run_is_its_heldout_loss_through_base_plus_adapter(sft_lora, base, chats, capsys,
                                                                               tmp_path):
    _, result = sft_lora
    got = eval_json(capsys, "--model", result.run_dir)
    model = tformer.load(result.run_dir)
    assert lora_layers(model)
    heldout = split_rows(read_examples(chats), 0.25, 0)[1]
    assert got["val_loss"] == pytest.approx(sft_by_hand(model, result.run_dir, heldout), abs=1e-5)
    assert got["val_loss"] == pytest.approx([r for r in result.records if "val_loss" in r][-1]["val_loss"], abs=1e-5)
    assert abs(got["val_loss"] - sft_by_hand(tformer.load(base), result.run_dir, heldout)) > 1e-3   # not the base's
    some = write_jsonl(tmp_path / "some.jsonl", [{"prompt": question(i), "completion": " yes"} for i in range(3)])
    got = eval_json(capsys, "--model", result.run_dir, "--data", str(some))
    assert got["val_loss"] == pytest.approx(sft_by_hand(model, result.run_dir, read_examples(some)), abs=1e-5)


@pytest.mark.parametrize("lora", [[], ["--lora-r", "2"]], ids=["full", "lora"])
def test_init_from_a_lora_run_starts_from_base_plus_adapter_merged(lora, sft_lora, chats, tmp_path):
    from tformer.training.session import prepare

    _, result = sft_lora
    ids = torch.arange(3, 30).unsqueeze(0)
    with torch.no_grad():
        adapted = tformer.load(result.run_dir)(ids)
    plan = prepare("sft", init=result.run_dir, data=str(chats), max_steps=1, out=str(tmp_path / "run"),
                   progress=False, **({"lora_r": 2} if lora else {}))
    start = plan.task.build_model().eval()
    assert not lora_layers(start)                                    # one plain model ...
    with torch.no_grad():
        torch.testing.assert_close(start(ids), adapted, rtol=0, atol=1e-5)   # ... computing base + adapter
    fitted = plan.fit()
    assert fitted.step == 1
    if lora:   # the merged model is the new run's base, saved once as RUN/base/
        with torch.no_grad():
            torch.testing.assert_close(tformer.load(tmp_path / "run" / "base")(ids), adapted, rtol=0, atol=1e-5)


def test_init_from_an_int8_lora_run_is_refused_in_one_line(base, chats, tmp_path, capsys):
    _, result = run(["--task", "sft", "--init", str(base), "--data", str(chats), *COMMON, "--lora-r", "2",
                     "--lora-int8", "--max-steps", "1", "--out", str(tmp_path / "int8")])
    out = tmp_path / "run"
    code = main(["train", "--task", "sft", "--init", result.run_dir, "--data", str(chats), "--max-steps", "1",
                 "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    assert err[-1].startswith("error: ") and "int8" in err[-1] and str(base) in err[-1]


# --- torchrun ---------------------------------------------------------------------------------------
def torchrun(argv: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tformer", "train", *argv]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def assert_same_adapters(one: str, two: Path) -> None:
    a, b = (lora_state_dict(tformer.load(r)) for r in (one, two))
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    state = json.loads((resolve(two) / "trainer_state.json").read_text())
    assert state["world_size"] == 2


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_dpo_lora_under_torchrun_matches_one_process(dpo_lora, base, prefs, tmp_path):
    _, one = dpo_lora
    torchrun(["--task", "dpo", "--init", str(base), "--data", str(prefs), *COMMON, "--dpo-beta", str(BETA),
              "--lr", "1e-2", "--lora-r", "2", "--lora-dropout", "0", "--lora-targets", "q,v,o", "--max-steps", "4",
              "--eval-every", "4", "--out", str(tmp_path / "two")])
    assert_same_adapters(one.run_dir, tmp_path / "two")
    for a, b in zip(records(one.run_dir), records(tmp_path / "two"), strict=True):   # each process's half, averaged
        for name in ("train_loss", *REWARD_METRICS, "val_accuracy", "val_rewards/margins"):
            assert (name in a) == (name in b) and (name not in a or abs(a[name] - b[name]) <= 1e-4), name


def test_sft_lora_under_torchrun_matches_one_process_with_the_same_micro_batches(base, chats, tmp_path):
    flags = ["--task", "sft", "--init", str(base), "--data", str(chats), *COMMON, "--lr", "1e-2", "--lora-r", "2",
             "--lora-dropout", "0", "--max-steps", "3", "--eval-every", "3"]
    # SFT's loss is a mean over each micro-batch's trained tokens: 2 processes of 4 rows each match one
    # process accumulating 2 micro-batches of the same 4 rows
    _, one = run([*flags, "--grad-accum", "2", "--out", str(tmp_path / "one")])
    torchrun([*flags, "--out", str(tmp_path / "two")])
    assert_same_adapters(one.run_dir, tmp_path / "two")
    assert records(one.run_dir)[-1]["val_loss"] == pytest.approx(records(tmp_path / "two")[-1]["val_loss"], abs=1e-4)
