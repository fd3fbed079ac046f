"""Instruction tuning (`tformer train --task sft --init BASE --data chats.jsonl`): a decoder learns to
answer, its loss on the assistant's tokens only (see tformer.data.chat for the data, the template and
which tokens are trained).

The template: --chat-template FILE, else the base checkpoint's (chat_template.jinja or
tokenizer_config.json, as the server finds it), else tformer.data.chat_template.DEFAULT_TEMPLATE (the
tokenizer's BOS and EOS around each turn). Whichever it is, every checkpoint of the run carries it as
chat_template.jinja, with a tokenizer_config.json naming the BOS and EOS tokens, so `tformer serve`,
`tformer.load` + the server's find_chat_template and the exports render prompts as training did. The
tokenizer's BOS and EOS become special tokens the template's text is read back into (a char tokenizer's
"<eos>" is otherwise five characters); user text still never produces them.

Packing (--packing, default on): conversations are grouped into rows of --context tokens (best-fit
decreasing); each keeps its own positions (0, 1, ... restarting) and attends only within itself
(model.masks.segment_mask), so a packed row computes what each conversation computes alone. A
conversation longer than --context is skipped, and the run says how many were (a cut one would lose
the end-of-turn that teaches the model to stop).

Validation: the mean cross-entropy over every trained token of the held-out conversations (the last
--val-fraction of a seeded shuffle); the sample answers the first held-out prompt greedily.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import instruct
from ..data.chat import IGNORE, Renderer, collate, pack, read_examples
from ..data.chat_template import (
    DEFAULT_TEMPLATE,
    TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    ChatTemplate,
    chat_template_source,
    tokenizer_config,
)
from ..data.files import split_rows, step_generator
from ..data.tokenizers import Tokenizer
from ..errors import ConfigError, DataError, warn
from ..model.masks import segment_mask
from ..training.config import TrainOptions
from ..training.options import option
from .common import dropout_overrides

SAMPLE_TOKENS = 48  # the progress sample's reply length at most


# The walk-through's second step: full rows of 256 tokens (16 packed conversations of ~60 tokens each), the
# rate of a small model's fine-tuning, a fixed number of steps (the same model on any machine), no dropout
# (on validation dropout 0.1 led by 2.7 points of sentiment on 300 items at 1.45x the step time, ~1.1x since the
# dropout kernel; 0.1 without attention dropout by as much but 3 points behind on numbers: BENCHMARKS.md, "The
# assistant walk-through");
# chosen on the validation split (tformer.data.instruct), never on the test split `tformer eval` reports.
INSTRUCT = {"batch_size": 16, "lr": 2e-3, "warmup": 30, "weight_decay": 0.0, "max_steps": 1800, "eval_every": 600}


@dataclass
class SFTOptions(TrainOptions):
    title = "instruction tuning (--task sft)"
    packing: bool = option(True, "pack short conversations into full --context rows, each attending only to "
                           "itself (default: on)", action=argparse.BooleanOptionalAction, flag_default=None)
    train_on_prompt: bool = option(False, "train on every token, prompts included (default: the assistant's "
                                   "replies and completions only)", action=argparse.BooleanOptionalAction,
                                   flag_default=None)
    chat_template: str | None = option(None, "a Jinja chat template file (default: the --init model's, else "
                                       "tformer's: BOS role\\n content EOS per turn)", metavar="FILE")


class SFTTask:
    name = "sft"
    Options = SFTOptions
    default_data = None

    @staticmethod
    def recipe(data: str, init: str | None, time_budget: float | None) -> dict[str, Any]:
        """A fine-tuning starting point (not a measured best): small batches, a lower peak rate than from
        scratch, a short warm-up, no weight decay pulling the base's weights to zero. On tformer-instruct (the
        README's walk-through, from the `--task lm --data tformer-instruct` model): INSTRUCT."""
        if data == instruct.NAME:
            return INSTRUCT
        return {"batch_size": 8, "lr": 3e-4, "warmup": 10, "weight_decay": 0.0, "eval_every": 100}

    @classmethod
    def heldout(cls, meta: dict[str, Any], data: str | None = None) -> list:
        """The examples (tformer.data.chat.Example) `evaluate` scored: the file `data` whole, else the run's
        held-out split rebuilt from meta()."""
        if data is not None:
            return instruct.examples("test") if data == instruct.NAME else read_examples(data)
        return read_splits(meta["data"], meta["val_fraction"], meta["seed"])[1]

    def __init__(self, opts: SFTOptions, tokenizer: Tokenizer | None = None, init: str | None = None):
        if not opts.data:
            raise ConfigError("--task sft needs --data FILE.jsonl (conversations or prompt-completion pairs)")
        self.load_base(opts, tokenizer, init)
        renderer = Renderer(self.tokenizer, self.template, opts.train_on_prompt)
        train, val = read_splits(opts.data, opts.val_fraction, opts.seed)
        if not val:
            raise DataError(f"{opts.data}: too few examples to hold any out for validation (give more)")
        self.val_examples = val
        self.train_rows, self.stops = self._rows([renderer(e) for e in train], "training")
        self.val_rows, _ = self._rows([renderer(e) for e in val], "validation")
        self.prompt = self._sample_prompt(renderer, val[0])

    def load_base(self, opts, tokenizer: Tokenizer | None, init: str | None) -> None:
        """The decoder a run fine-tunes (--init; on --resume the run's base): self.base, cfg, context, tokenizer,
        and the chat template (self.template) with the files that carry it (self.extra_files)."""
        base = init or opts.init     # on --resume the run's base still names the shape and the template
        if base is None:
            raise ConfigError(f"--task {self.name} fine-tunes a decoder: give --init CHECKPOINT")
        from ..checkpoints.format import load_tokenizer, read_config
        from ..checkpoints.layout import resolve
        from ..model.config import ModelConfig

        self.opts, self.init, self.base = opts, init, resolve(base)
        config = read_config(self.base)
        if config["architecture"] != "Decoder":
            raise ConfigError(f"--init {base} is a {config['architecture']}, not a Decoder")
        self.cfg = ModelConfig.from_dict(config["config"]).replace(**dropout_overrides(opts))   # --dropout given
        self.context = opts.context or self.cfg.max_seq_len
        if self.context > self.cfg.max_seq_len:
            raise ConfigError(f"--context {self.context} is longer than the model's max_seq_len {self.cfg.max_seq_len}")
        self.tokenizer = tokenizer or load_tokenizer(self.base)
        self.template, self.extra_files = self._template()

    def _template(self) -> tuple[ChatTemplate, dict[str, bytes]]:
        """The run's template, and the files that carry it into each checkpoint."""
        tok = self.tokenizer
        if self.opts.chat_template is not None:
            path = Path(self.opts.chat_template)
            if not path.is_file():
                raise ConfigError(f"--chat-template {path}: no such file")
            source = path.read_text(encoding="utf-8")
        else:
            source = chat_template_source(self.base) or DEFAULT_TEMPLATE
        config = {k: v for k, v in tokenizer_config(self.base).items() if k != "chat_template"}
        for role in ("bos", "eos", "pad"):
            token_id = getattr(tok, f"{role}_id")
            if token_id is not None:
                config.setdefault(f"{role}_token", tok.hf.id_to_token(token_id))
        if source == DEFAULT_TEMPLATE and (tok.bos_id is None or tok.eos_id is None):
            raise ConfigError(f"--init {self.base} has no chat template and its tokenizer no BOS/EOS token to "
                              "write tformer's; give one with --chat-template FILE")
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        readable = [t.get("content") if isinstance(t, dict) else t for t in
                    (config.get("bos_token"), config.get("eos_token"))]
        make_special(tok, [t for t in readable if t])
        try:
            template = ChatTemplate(source, readable[0] or "", readable[1] or "")
        except ValueError as e:
            raise ConfigError(f"{self.opts.chat_template or self.base}: {e}") from None
        files = {TEMPLATE_FILE: source.encode("utf-8"),
                 TOKENIZER_CONFIG: json.dumps(config, indent=2, ensure_ascii=False).encode("utf-8")}
        return template, files

    def _rows(self, rendered: list, split: str) -> tuple[list, set[int]]:
        """Rendered examples -> rows (packed, or one each); the ids that end trained turns."""
        fit = fitting(rendered, self.context, self.opts.data, split)
        stops = {r.ids[i] for r in fit for i in range(len(r.ids))
                 if r.trained[i] and (i + 1 == len(r.ids) or not r.trained[i + 1])}
        groups = pack([len(r.ids) for r in fit], self.context) if self.opts.packing else [[i] for i in range(len(fit))]
        return [[fit[i] for i in g] for g in groups], stops

    def _sample_prompt(self, renderer: Renderer, example) -> list[int]:
        if example.messages is None:
            return self.tokenizer.encode(example.prompt)
        first = next((i for i, m in enumerate(example.messages) if m["role"] == "assistant"), len(example.messages))
        text = renderer.render(example.messages[:first], True, example)
        return renderer.reader.encode(text, add_special_tokens=False).ids

    # --- the protocol ------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        from ..checkpoints.adapter import merged
        from ..checkpoints.format import load
        from ..model.models import Decoder

        model = Decoder(self.cfg)
        model.load_state_dict(merged(load(self.base), self.base).state_dict())   # a LoRA run: base + adapter
        return model

    def batch(self, step: int, split: str = "train") -> dict[str, Tensor]:
        rows = self.train_rows if split == "train" else self.val_rows
        picks = torch.randint(len(rows), (self.opts.batch_size,), generator=step_generator(self.opts.seed, step))
        return collate([rows[int(i)] for i in picks], self.pad_id)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0  # never a label (IGNORE)

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        # the mean cross-entropy over the trained tokens (IGNORE = the model's -100), logits never whole (lm_loss.py)
        return model(batch["input_ids"], segment_mask(batch["segments"]), batch["positions"], labels=batch["labels"])

    def tokens(self, batch: dict[str, Tensor]) -> int:
        return int((batch["segments"] > 0).sum())

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"val_loss": trained_loss(model, self.val_rows, self.pad_id, self.opts.batch_size)}

    def sample(self, model: nn.Module) -> str:
        """The model's greedy reply to the first held-out prompt, up to the end of its turn."""
        from ..generation import generate

        device = next(model.parameters()).device
        room = min(SAMPLE_TOKENS, self.cfg.max_seq_len - len(self.prompt))
        if room <= 0:
            return ""
        was_training = model.training
        model.eval()
        try:
            out = generate(model, torch.tensor([self.prompt], device=device), max_new_tokens=room,
                           do_sample=False, eos_token_id=sorted(self.stops))
        finally:
            model.train(was_training)
        return self.tokenizer.decode(out[0, len(self.prompt):])

    def meta(self) -> dict[str, Any]:
        return {"data": str(self.opts.data), "context": self.context, "val_fraction": self.opts.val_fraction,
                "seed": self.opts.seed, "packing": self.opts.packing, "train_on_prompt": self.opts.train_on_prompt}


def fitting(rendered: list, context: int, source: str, split: str, noun: str = "example") -> list:
    """The rendered examples (tformer.data.chat.Rendered, or tuples of them: a DPO pair's sides) of the file
    `source` that fit `context` tokens and train a token after the first, each side; the others skipped with
    a warning; DataError if none is left."""
    fit = [x for x in rendered if all(len(r.ids) <= context and any(r.trained[1:])
                                      for r in (x if isinstance(x, tuple) else (x,)))]
    if len(fit) < len(rendered):
        warn(f"{len(rendered) - len(fit)} of {len(rendered)} {split} {noun}s were skipped: longer than "
             f"--context {context} tokens, or nothing to train after the first token")
    if not fit:
        raise DataError(f"{source}: no {split} {noun} fits --context {context} tokens")
    return fit


def trained_loss(model: nn.Module, rows: list, pad_id: int, batch_size: int = 8) -> float:
    """The mean cross-entropy over every trained token of `rows` (lists of tformer.data.chat.Rendered, packed or
    one each), under no_grad: SFT's validation loss, and what `tformer eval` reports for an SFT run."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in collate(rows[start:start + batch_size], pad_id).items()}
            logits = model(batch["input_ids"], segment_mask(batch["segments"]), batch["positions"])
            labels = batch["labels"].flatten()
            total += float(F.cross_entropy(logits.flatten(0, 1).float(), labels, ignore_index=IGNORE,
                                           reduction="sum"))
            count += int((labels != IGNORE).sum())
    return total / count


def read_splits(data: str, val_fraction: float, seed: int) -> tuple[list, list]:
    """(training, validation) examples: tformer-instruct's own splits, else a file's seeded split."""
    if data == instruct.NAME:
        return instruct.examples("train"), instruct.examples("validation")
    return split_rows(read_examples(data), val_fraction, seed)


def make_special(tokenizer: Tokenizer, tokens: list[str]) -> None:
    """Make `tokens` (already in the vocabulary) special: a template's text reads back into their ids."""
    from tokenizers import AddedToken

    known = {t.content for t in tokenizer.hf.get_added_tokens_decoder().values()}
    missing = [t for t in tokens if t not in known and tokenizer.hf.token_to_id(t) is not None]
    if missing:
        tokenizer.hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
