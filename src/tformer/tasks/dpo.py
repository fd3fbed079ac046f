"""Preference tuning with DPO (`tformer train --task dpo --init BASE --data pairs.jsonl`): a decoder learns to
prefer the chosen response of each pair over the rejected one (tformer.training.dpo: trl's sigmoid loss).

One pair per line; the prompt is plain text, or OpenAI's messages rendered with the chat template and its
generation prompt (the template as --task sft finds it: --chat-template, the base's, tformer's default):

    {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}
    {"prompt": [{"role": "user", "content": "Hi"}], "chosen": "Hello!", "rejected": "Go away."}

A response's tokens are what tformer.data.chat.Renderer trains for a completion: a plain one and EOS, or
the assistant turn the template writes (its end-of-turn included). A pair whose longer side exceeds
--context tokens is skipped, and the run says how many were.

The reference model is the frozen --init model. With --lora-r it is the trained model itself with its
adapters turned off (tformer.model.lora.adapters_off): no second copy of the weights. Without LoRA the
task keeps one frozen copy of the --init weights (made on the first loss, on the model's device). Its
log-probabilities are computed per batch under no_grad, in eval mode (no dropout), nothing precomputed. The
policy trains without the model's dropout too (trl's `disable_dropout`, on by default), unless --dropout or
--attn-dropout is given; LoRA's own dropout (--lora-dropout) stays as set.

Training logs, next to the DPO loss, trl's rewards/chosen, rewards/rejected, rewards/margins and
rewards/accuracies of the steps (the implicit reward of a response is beta * (log pi - log pi_ref)); validation,
over the held-out pairs (the last --val-fraction of a seeded shuffle), val_loss, the preference accuracy
val_accuracy (the share of pairs whose chosen response's reward is the higher) and val_rewards/* (`score_pairs`,
which `tformer eval` calls too: the run records its --init, the reference of a run without LoRA).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..data import instruct
from ..data.chat import Example, Rendered, Renderer, check_messages, json_object, read_jsonl
from ..data.files import split_rows, step_generator
from ..data.tokenizers import Tokenizer
from ..errors import ConfigError, DataError
from ..model.lora import adapters_off, lora_layers
from ..training.config import TrainOptions
from ..training.dpo import dpo_loss, sequence_logprobs
from ..training.options import option, positive_float
from .sft import SFTTask, fitting

SIDES = ("chosen", "rejected")


# The walk-through's third step: rank-8 adapters (the reference is the base with them off), 300 steps of 8
# pairs. Chosen on the validation split among LoRA at 2e-4 and 5e-4, LoRA on every projection at 1e-3 and full
# fine-tuning at 5e-5 to 5e-4: none raised the validation preference accuracy (most translation and continue
# pairs the SFT model gets wrong have the shorter wrong reply, which a summed log-probability favours by many
# nats); this one lowered the task figures least, LoRA at 1e-3 on every projection broke the replies' form
# (BENCHMARKS.md, "The assistant walk-through").
INSTRUCT = {"lora_r": 8, "batch_size": 8, "lr": 2e-4, "warmup": 10, "weight_decay": 0.0, "max_steps": 300,
            "eval_every": 100}


@dataclass
class DPOOptions(TrainOptions):
    title = "preference tuning (--task dpo)"
    dpo_beta: float = option(0.1, "DPO temperature beta: how far the policy may move from the reference "
                             "(default 0.1)", type=positive_float)
    chat_template: str | None = option(None, "a Jinja chat template file (default: the --init model's, else "
                                       "tformer's: BOS role\\n content EOS per turn)", metavar="FILE")


@dataclass
class Pair:
    where: str          # "file:line"
    chosen: Example
    rejected: Example


def parse_pair(line: str, where: str) -> Pair:
    """One JSONL line -> a Pair; DataError "file:line: ..." for what is malformed or missing."""
    obj = json_object(line, where)
    missing = [k for k in ("prompt", *SIDES) if k not in obj]
    if missing:
        raise DataError(f"{where}: missing {', '.join(missing)} (expected {{\"prompt\": ..., \"chosen\": \"...\", "
                        f"\"rejected\": \"...\"}})")
    for side in SIDES:
        if not isinstance(obj[side], str):
            raise DataError(f"{where}: {side} must be a string, got {type(obj[side]).__name__}")
    prompt = obj["prompt"]
    if isinstance(prompt, list):
        prompt = check_messages(prompt, where, "prompt")
        replies = [[{"role": "assistant", "content": obj[side]}] for side in SIDES]
        sides = [Example(where, messages=prompt + r, prompt=prompt, completion=r) for r in replies]
    elif isinstance(prompt, str):
        sides = [Example(where, prompt=prompt, completion=obj[side]) for side in SIDES]
    else:
        raise DataError(f"{where}: prompt must be a string or a list of messages, got {type(prompt).__name__}")
    return Pair(where, *sides)


def read_pairs(path) -> list[Pair]:
    return read_jsonl(path, parse_pair)


def instruct_pairs(split: str) -> list[Pair]:
    return [Pair(*sides) for sides in instruct.preferences(split)]


def pair_splits(data: str, val_fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(training, validation) pairs: tformer-instruct's preference splits, else a file's seeded split."""
    if data == instruct.NAME:
        return instruct_pairs("train"), instruct_pairs("validation")
    return split_rows(read_pairs(data), val_fraction, seed)


def collate_pairs(pairs: list[tuple[Rendered, Rendered]], pad_id: int) -> dict[str, Tensor]:
    """(B, T) tensors per side, T the longest of both sides: {side}_ids (right-padded with pad_id),
    {side}_mask (1 on real tokens), {side}_response (1 on the response's tokens)."""
    width = max(len(r.ids) for pair in pairs for r in pair)
    out = {}
    for i, side in enumerate(SIDES):
        ids = torch.full((len(pairs), width), pad_id)
        mask, response = torch.zeros_like(ids), torch.zeros_like(ids)
        for b, pair in enumerate(pairs):
            r = pair[i]
            ids[b, :len(r.ids)] = torch.tensor(r.ids)
            mask[b, :len(r.ids)] = 1
            response[b, :len(r.ids)] = torch.tensor(r.trained, dtype=torch.long)
        out |= {f"{side}_ids": ids, f"{side}_mask": mask, f"{side}_response": response}
    return out


def render_pairs(renderer: Renderer, pairs: list[Pair], context: int, source: str,
                 split: str) -> list[tuple[Rendered, Rendered]]:
    """Each pair of the file `source` rendered (chosen, rejected), but those with a side longer than `context`
    tokens or with no response token to score: skipped with a warning; DataError if none is left."""
    return fitting([(renderer(p.chosen), renderer(p.rejected)) for p in pairs], context, source, split, "pair")


@contextmanager
def reference(model: nn.Module, frozen: nn.Module | None) -> Iterator[nn.Module]:
    """The reference model, in eval mode: `model` with its LoRA adapters off, else the `frozen` copy."""
    if not lora_layers(model):
        if frozen is None:
            raise ValueError("DPO without LoRA adapters needs a frozen reference model")
        yield frozen
        return
    was_training = model.training
    model.eval()
    try:
        with adapters_off(model):
            yield model
    finally:
        model.train(was_training)


def pair_loss(model: nn.Module, frozen: nn.Module | None, batch: dict[str, Tensor],
              beta: float) -> tuple[Tensor, dict[str, float]]:
    """(DPO loss, trl's reward metrics) of a batch of pairs (collate_pairs) on the model's device; the
    reference as `reference(model, frozen)` gives it."""
    ids, mask, response = (torch.cat([batch[f"{s}_{k}"] for s in SIDES]) for k in ("ids", "mask", "response"))
    with torch.no_grad(), reference(model, frozen) as ref:   # first: the policy's is the forward backward follows
        reference_logps = sequence_logprobs(ref, ids, mask, response)
    policy = sequence_logprobs(model, ids, mask, response)
    n = len(batch["chosen_ids"])
    return dpo_loss(policy[:n], policy[n:], reference_logps[:n], reference_logps[n:], beta)


def score_pairs(model: nn.Module, frozen: nn.Module | None, pairs: list[tuple[Rendered, Rendered]], pad_id: int,
                beta: float, batch_size: int = 8) -> dict[str, float]:
    """Over every pair: val_loss (the DPO loss), val_accuracy (chosen reward > rejected reward) and the mean
    rewards (val_rewards/chosen, /rejected, /margins), under no_grad; pass `model` in eval mode."""
    device = next(model.parameters()).device
    sums: dict[str, float] = {}
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start:start + batch_size]
            batch = {k: v.to(device) for k, v in collate_pairs(chunk, pad_id).items()}
            loss, metrics = pair_loss(model, frozen, batch, beta)
            for k, v in {"loss": float(loss), **metrics}.items():
                sums[k] = sums.get(k, 0.0) + v * len(chunk)
    mean = {k: v / len(pairs) for k, v in sums.items()}
    return {"val_loss": mean["loss"], "val_accuracy": mean["rewards/accuracies"],
            **{f"val_{k}": mean[k] for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")}}


class DPOTask(SFTTask):
    """--task dpo: the base, tokenizer, template, model and sample as --task sft's; pairs, loss and
    validation of its own."""
    name = "dpo"
    Options = DPOOptions
    sequences_per_row = 2    # for the memory check (inference.limits.check_task): a row is a pair,
    reference_copy = True    # and without LoRA the reference is a second, frozen copy of the model

    @staticmethod
    def recipe(data: str, init: str | None, time_budget: float | None) -> dict[str, Any]:
        """A starting point (not a measured best): small batches, a low rate (DPO moves a tuned model a little).
        On tformer-instruct (the README's walk-through): INSTRUCT."""
        if data == instruct.NAME:
            return INSTRUCT
        return {"batch_size": 8, "lr": 5e-5, "warmup": 10, "weight_decay": 0.0, "eval_every": 100}

    @classmethod
    def heldout(cls, meta: dict[str, Any], data: str | None = None) -> list[Pair]:
        """The pairs `evaluate` scored: the file `data` whole, else the run's held-out split rebuilt from meta()."""
        if data is not None:
            return instruct_pairs("test") if data == instruct.NAME else read_pairs(data)
        return pair_splits(meta["data"], meta["val_fraction"], meta["seed"])[1]

    def __init__(self, opts: DPOOptions, tokenizer: Tokenizer | None = None, init: str | None = None):
        if not opts.data:
            raise ConfigError("--task dpo needs --data FILE.jsonl (prompt, chosen, rejected per line)")
        self.load_base(opts, tokenizer, init)
        if opts.dropout is None and opts.attn_dropout is None:       # trl's disable_dropout (its default): the
            self.cfg = self.cfg.replace(dropout=0.0, attn_dropout=0.0)   # policy's log-probs as the reference's
        renderer = Renderer(self.tokenizer, self.template)
        train, val = pair_splits(opts.data, opts.val_fraction, opts.seed)
        if not val:
            raise DataError(f"{opts.data}: too few pairs to hold any out for validation (give more)")
        self.train_pairs = render_pairs(renderer, train, self.context, opts.data, "training")
        self.val_pairs = render_pairs(renderer, val, self.context, opts.data, "validation")
        self.stops = {r.ids[-1] for pair in self.train_pairs for r in pair}     # each response's last token
        chosen = self.val_pairs[0][0]
        self.prompt = chosen.ids[:max(1, chosen.trained.index(True))]            # what sample() answers
        self.ref: nn.Module | None = None                                        # without LoRA: the frozen copy

    def frozen(self, model: nn.Module) -> nn.Module | None:
        """The reference copy of the --init weights (made on first use, on the model's device); None with LoRA."""
        if lora_layers(model):
            return None
        if self.ref is None:
            self.ref = self.build_model().requires_grad_(False).eval().to(next(model.parameters()).device)
        return self.ref

    # --- the protocol (build_model, sample, pad_id: SFTTask's) ------------------------------------
    def batch(self, step: int, split: str = "train") -> dict[str, Tensor]:
        pairs = self.train_pairs if split == "train" else self.val_pairs
        picks = torch.randint(len(pairs), (self.opts.batch_size,), generator=step_generator(self.opts.seed, step))
        return collate_pairs([pairs[int(i)] for i in picks], self.pad_id)

    def loss_and_metrics(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        """The DPO loss and trl's rewards/* of the batch (tformer.training.steplog logs them)."""
        return pair_loss(model, self.frozen(model), batch, self.opts.dpo_beta)

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return self.loss_and_metrics(model, batch)[0]

    def tokens(self, batch: dict[str, Tensor]) -> int:
        return int(batch["chosen_mask"].sum() + batch["rejected_mask"].sum())

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return score_pairs(model, self.frozen(model), self.val_pairs, self.pad_id, self.opts.dpo_beta,
                           self.opts.batch_size)

    def meta(self) -> dict[str, Any]:
        return {"data": str(self.opts.data), "context": self.context, "val_fraction": self.opts.val_fraction,
                "seed": self.opts.seed, "dpo_beta": self.opts.dpo_beta,
                "init": str(Path(self.base).resolve())}   # the reference `tformer eval` scores against (no LoRA)
