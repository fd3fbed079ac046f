"""The memory check before a run (inference.limits.check_task) against what a trainer really holds: its
tensors (weights, int8 weights, a reference copy), a gradient per trained weight, AdamW's moments and what
autograd saves in one full-length micro-batch, for full fine-tuning, LoRA, LoRA on an int8 base and DPO
(two sequences per row, a frozen reference copy without LoRA). The estimate is a lower bound: a run that
fits is never refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tformer
from tformer.cli import build_parser
from tformer.data.tokenizers import Tokenizer
from tformer.errors import ConfigError
from tformer.inference import limits
from tformer.model.config import ModelConfig
from tformer.model.models import Decoder
from tformer.training.loop import Trainer

TEXT = "what is one two three plus? yes no user assistant " * 20
CONTEXT, ROWS = 32, 4


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Wide layers, a small vocabulary and short rows: the weights are most of the memory."""
    tok = Tokenizer.train_bpe(TEXT, 270)
    torch.manual_seed(0)
    cfg = ModelConfig(kind="decoder", vocab_size=tok.vocab_size, d_model=256, n_heads=4, n_layers=2, d_ff=1024,
                      max_seq_len=CONTEXT, positional="learned", pad_token_id=tok.pad_id, bos_token_id=tok.bos_id,
                      eos_token_id=tok.eos_id, dropout=0.0)
    path = tmp_path_factory.mktemp("limits") / "base"
    tformer.save(Decoder(cfg).eval(), path, tokenizer=tok)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("data")
    words = ["one", "two", "three"]
    files = {"sft": [{"messages": [{"role": "user", "content": f"what is {w}?"},
                                   {"role": "assistant", "content": "yes"}]} for w in words * 4],
             "dpo": [{"prompt": f"what is {w}?", "chosen": " yes", "rejected": " no"} for w in words * 4]}
    for name, rows in files.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {name: folder / f"{name}.jsonl" for name in files}


def trainer_after_one_step(task: str, flags: list[str], base, data, out: Path) -> Trainer:
    from tformer.cli.train import prepare

    argv = ["train", "--task", task, "--init", str(base), "--data", str(data[task]), "--batch-size", str(ROWS),
            "--max-steps", "1", "--no-progress", "--precision", "fp32", "--val-fraction", "0.25", "--out", str(out),
            *flags]
    plan = prepare(build_parser().parse_args(argv))
    trainer = Trainer(plan.task, plan.cfg, args=plan.args)
    trainer.run()
    return trainer


def full_length_batch(task: str, vocab: int) -> dict[str, torch.Tensor]:
    """The micro-batch the check is about: ROWS rows of CONTEXT tokens, every token trained."""
    ids = torch.randint(3, vocab, (ROWS, CONTEXT), generator=torch.Generator().manual_seed(0))
    if task == "sft":
        return {"input_ids": ids, "labels": ids.roll(-1, 1), "positions": torch.arange(CONTEXT).expand(ROWS, -1),
                "segments": torch.ones_like(ids)}
    ones = torch.ones_like(ids)
    return {k: v for side, x in (("chosen", ids), ("rejected", ids.flip(1)))
            for k, v in ((f"{side}_ids", x), (f"{side}_mask", ones), (f"{side}_response", ones))}


def held_bytes(trainer: Trainer, task: str) -> int:
    """Every distinct storage of the model's tensors, the reference copy's, AdamW's state and the tensors
    autograd saves in the loss of a full-length micro-batch; plus a gradient per trained parameter."""
    storages: dict[int, int] = {}

    def add(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model = trainer.plain
    for module in (model, getattr(trainer.task, "ref", None) or model):
        for t in module.state_dict().values():
            add(t)
    for state in trainer.opt.state.values():
        for t in state.values():
            add(t)
    with torch.autograd.graph.saved_tensors_hooks(add, lambda t: t):
        trainer.task.loss(model, full_length_batch(task, model.cfg.vocab_size))
    return sum(storages.values()) + sum(4 * p.numel() for p in model.parameters() if p.requires_grad)


def estimate(trainer: Trainer, monkeypatch) -> int:
    """check_task's estimate for the run's task and options (the bytes it compares with the memory there is)."""
    seen = []
    real = limits.training_bytes
    monkeypatch.setattr(limits, "training_bytes", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    limits.check_task(trainer.task, trainer.cfg)
    return seen[-1]


CASES = {"sft": ("sft", []), "sft-lora": ("sft", ["--lora-r", "2"]), "dpo": ("dpo", []),
         "dpo-lora": ("dpo", ["--lora-r", "2"]), "dpo-lora-int8": ("dpo", ["--lora-r", "2", "--lora-int8"])}


@pytest.fixture(scope="module")
def measured(base, data, tmp_path_factory) -> dict[str, tuple[Trainer, int]]:
    out = {}
    for name, (task, flags) in CASES.items():
        trainer = trainer_after_one_step(task, flags, base, data, tmp_path_factory.mktemp(name) / "run")
        out[name] = trainer, held_bytes(trainer, task)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_estimate_is_a_lower_bound(name, measured, monkeypatch):
    trainer, held = measured[name]
    assert estimate(trainer, monkeypatch) <= held       # never refuses a run that fits


def test_lora_is_estimated_as_a_frozen_base_not_as_full_fine_tuning(measured, monkeypatch):
    need = {name: estimate(measured[name][0], monkeypatch) for name in ("sft", "sft-lora", "dpo-lora-int8", "dpo-lora")}
    assert need["sft"] > measured["sft-lora"][1]          # full fine-tuning's estimate would refuse what fits
    assert need["sft-lora"] < 0.5 * need["sft"] and need["dpo-lora-int8"] < need["dpo-lora"]


def test_dpo_counts_its_pairs_and_its_reference_copy(measured, monkeypatch):
    """What DPO holds beyond SFT on the same model (a second sequence per row, the frozen reference): the
    estimate counts at least 40% of it, never more than all of it."""
    extra_held = measured["dpo"][1] - measured["sft"][1]
    extra_need = estimate(measured["dpo"][0], monkeypatch) - estimate(measured["sft"][0], monkeypatch)
    assert 0.4 * extra_held <= extra_need <= extra_held


def test_dpo_without_lora_is_refused_where_it_does_not_fit_and_with_lora_it_is_not(measured, monkeypatch):
    (full, full_held), (lora, _) = measured["dpo"], measured["dpo-lora"]
    monkeypatch.setattr(limits, "device_memory", lambda device: full_held // 2)
    with pytest.raises(ConfigError, match=f"training with {2 * ROWS} sequences of {CONTEXT} tokens"):
        limits.check_task(full.task, full.cfg)    # a pair per row: twice the sequences
    limits.check_task(lora.task, lora.cfg)        # the reference is the base with the adapters off: no copy
