"""benchmarks/equal_steps.py's protocol on a few steps: both sides are fed the batches `tformer train` would
train on, are scored on the items `tformer eval` would score (rebuilt here through the task's own heldout),
and the Hugging Face peer has tformer's parameter count within the stated tolerance. Not speed, not quality."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import equal_steps  # noqa: E402
from equal_steps_peers import CASES, PARAM_TOLERANCE, digest  # noqa: E402
from tformer.training.session import prepare  # noqa: E402


def fresh_task(case, steps: int, seed: int):
    """The task `tformer train --task T --max-steps steps --seed seed` builds, apart from the benchmark's."""
    return prepare(case.task, **case.options(), max_steps=steps, seed=seed, out="unused", progress=False).task


def batches_of(task, steps: int) -> tuple[str, int, int]:
    """(digest, tokens, rows) of the task's first `steps` training batches, hashed independently."""
    h, tokens, rows = hashlib.sha256(), 0, 0
    for step in range(steps):
        b = task.batch(step, "train")
        h.update(b"".join(k.encode() + b[k].contiguous().numpy().tobytes() for k in sorted(b)))
        tokens += int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
        rows += len(b["input_ids"])
    return h.hexdigest()[:16], tokens, rows


@pytest.mark.parametrize("name,seed", [("sentiment", 1), ("hamlet", 2)])
def test_both_sides_see_the_same_batches_and_test_items(name, seed):
    case, steps, limit = CASES[name], 3, 16
    r = equal_steps.pair(case, steps, seed, limit=limit)
    ours, peer = r["tformer"], r["hf"]

    task = fresh_task(case, steps, seed)
    fed, tokens, rows = batches_of(task, steps)
    assert ours["batches"] == peer["batches"] == fed
    assert ours["tokens"] == peer["tokens"] == tokens
    assert rows == steps * task.opts.batch_size

    # the test split as `tformer eval` rebuilds it from the run's meta, cut to `limit` items
    held = type(task).heldout(task.meta(), split="test")
    test = held if name == "hamlet" else [held[0][:limit], held[1][:limit]]
    assert ours["test"]["items"] == peer["test"]["items"] == digest(test)
    assert ours["validation"]["items"] == peer["validation"]["items"] != ours["test"]["items"]
    if name == "sentiment":   # the test texts are none of the validation texts (nor trained on: data.splits)
        val = type(task).heldout(task.meta(), split="validation")[0]
        assert not set(test[0]) & set(val)

    assert ours["lr"] == peer["lr"] == r["recipe_lr"]
    assert abs(r["param_ratio"] - 1) <= PARAM_TOLERANCE
    for side in (ours, peer):
        for figures in (side["validation"], side["test"]):
            assert all(torch.isfinite(torch.tensor(v)) for k, v in figures.items() if k != "items")


@pytest.mark.parametrize("name", ["sentiment", "hamlet", "numbers"])
def test_the_peer_has_the_recipe_models_shape(name):
    """Same width, depth, heads and vocabulary as the model the recipe builds, and the count of trained
    parameters within PARAM_TOLERANCE (the pretrained cases load the same MiniLM on both sides)."""
    case = CASES[name]
    task = fresh_task(case, 10, 0)
    ours = task.build_model()
    peer = case.peer(task, ours).hf
    cfg, hf = ours.cfg, peer.config
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.vocab_size) == \
        (cfg.d_model, cfg.n_layers, cfg.n_heads, task.tokenizer.vocab_size)
    assert abs(equal_steps.params(peer) / equal_steps.params(ours) - 1) <= PARAM_TOLERANCE
