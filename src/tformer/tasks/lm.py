"""Language modelling: a decoder learns to predict the next token of a text (the reference Task;
see tformer.training.config for the protocol).

Data: the built-in `hamlet` or a UTF-8 text file, cut in consecutive parts (tformer.data.splits): on
hamlet the first 80% trains, the next 10% validates (validation loss, --keep-best) and the last 10% is
the test split, which `tformer eval` scores and training never looks at; a user's file (and
tformer-instruct, whose test split is `tformer eval --data tformer-instruct`'s) is cut in two as before,
the first 90% training and the last 10% validating, unless --test-fraction asks for a test part too.
A loss is the mean cross-entropy over the WHOLE split, cut into consecutive, non-overlapping windows
of the context length (every token predicted exactly once): evaluation.lm.mean_loss, which `tformer
eval` calls on the text `LMTask.heldout` gives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..data import instruct
from ..data.files import lm_batch, read_text
from ..data.splits import split_text3
from ..data.tokenizers import Tokenizer, make_tokenizer
from ..errors import ConfigError, DataError
from ..evaluation.lm import mean_loss
from ..generation.settings import TEXT_DEFAULTS
from ..model.config import PRESETS, preset
from ..training.config import TrainOptions
from ..training.options import option
from .common import dropout_overrides, split_record, test_fraction_of


@dataclass
class LMOptions(TrainOptions):
    title = "language modelling (--task lm)"
    prompt: str | None = option(None, "text the progress samples start from (default: the start of the "
                                "validation text)")


# The recipe for the built-in hamlet (what `make demo` runs for 300 s; measured in BENCHMARKS.md, "Demo"):
# preset `mini` (4 layers of width 128, Llama-shaped), AdamW at 4e-3 after 30 warm-up steps, batch 16
# (many small steps), dropout 0.2 (Hamlet is small: the model overfits it) but none on attention weights
# (it costs step time), weight decay 0.8 (on validation at 4,200 steps, what 300 s make on the Intel AMX machine,
# seeds 1 and 1337: 1.6624 and 1.6718 against 0.5's 1.6801 and 1.6868, 1.2's 1.6823 and 1.6695, dropout 0.25's
# 1.6859 and 1.6835; at 2,700 steps, seed 1337, 1.6857 against 0.5's 1.6897; 0.5 had beaten 0.3 at 2,700 steps,
# 0.3 the generic 0.1 before), validation of a weight average (--ema) every 250 steps, keeping the best.
HAMLET = dict(preset="mini", batch_size=16, lr=4e-3, warmup=30, dropout=0.2, attn_dropout=0.0, weight_decay=0.8,
              ema=0.99, keep_best=True, eval_every=250)


# The walk-through's first step (README, "From a language model to an assistant"): the texts of
# tformer-instruct's training split, 4,000 BPE pieces for its English, Spanish, tweets and play, preset
# `mini` with rows of 256 tokens (the longest instruction with its reply fits one), no dropout (3.5 MB of
# text is not learnt by heart in 900 steps), a fixed number of steps so any machine makes the same model.
INSTRUCT = dict(tokenizer="bpe", vocab_size=4000, preset="mini", context=256, batch_size=16, lr=3e-3, warmup=30,
                dropout=0.0, max_steps=900, eval_every=300)


class LMTask:
    name = "lm"
    Options = LMOptions
    default_data = "hamlet"

    @staticmethod
    def recipe(data: str, init: str | None, time_budget: float | None) -> dict[str, Any]:
        """Characters as tokens (or a 2,000-piece BPE with --tokenizer bpe) and preset `small`; on
        hamlet the demo's recipe (HAMLET), measured best for 5 minutes on a 2-core CPU."""
        if init is not None:
            return {}
        if data == instruct.NAME:
            return INSTRUCT
        return {"tokenizer": "char", "vocab_size": 2000, "preset": "small", **(HAMLET if data == "hamlet" else {})}

    @classmethod
    def heldout(cls, meta: dict[str, Any], data: str | None = None, split: str = "test") -> str | None:
        """The text `tformer eval` scores: the file `data`, whole; else the run's `split` (test, validation;
        "held-out": the validation text of a run from before test splits), cut from the data `meta()`
        recorded as training cut it (this task's defaults when not recorded). None: the checkpoint records
        no training data."""
        if data is not None:
            return instruct.pretraining_text() if data == instruct.NAME else read_text(data)
        if "data" not in meta:
            return None
        text = instruct.pretraining_text() if meta["data"] == instruct.NAME else read_text(meta["data"])
        parts = split_text3(text, meta.get("val_fraction", cls.Options.val_fraction), meta.get("test_fraction", 0.0))
        return parts["validation" if split == "held-out" else split]

    def __init__(self, opts: LMOptions, tokenizer: Tokenizer | None = None, init: str | None = None):
        self.opts = opts
        self.seed, self.batch_size = opts.seed, opts.batch_size
        self.init = init
        text = instruct.pretraining_text() if opts.data == instruct.NAME else read_text(opts.data, errors=opts.errors)
        self.test_fraction = test_fraction_of(opts, opts.data == "hamlet")
        parts = split_text3(text, opts.val_fraction, self.test_fraction)
        self.train_text, self.val_text = parts["train"], parts["validation"]   # the test part stays unread
        if tokenizer is None and init is not None:
            from ..checkpoints.format import load_tokenizer
            tokenizer = load_tokenizer(init)
        if tokenizer is None:
            tokenizer = make_tokenizer(opts.tokenizer, [self.train_text], opts.vocab_size)
        self.tokenizer = tokenizer
        self.cfg = self._config()
        self.context = opts.context or self.cfg.max_seq_len
        if self.context > self.cfg.max_seq_len:
            raise ConfigError(f"--context {self.context} is longer than the model's max_seq_len "
                              f"{self.cfg.max_seq_len} (use --context {self.cfg.max_seq_len} or less)")
        self.train_ids = torch.tensor(tokenizer.encode(self.train_text), dtype=torch.long)
        self.val_ids = torch.tensor(tokenizer.encode(self.val_text), dtype=torch.long)
        for split, ids in (("training", self.train_ids), ("validation", self.val_ids)):
            if len(ids) < self.context + 2:
                raise DataError(f"{opts.data}: the {split} split has {len(ids)} tokens, fewer than one window of "
                                f"--context {self.context} (use more text or a smaller --context)")
        self.prompt = opts.prompt if opts.prompt else self.val_text[:16]

    def _config(self):
        init = self.init or self.opts.init     # on --resume the run's --init still names the shape (as sft's)
        if init is not None:
            from ..checkpoints.format import read_config
            from ..model.config import ModelConfig

            data = read_config(init)
            if data["architecture"] != "Decoder":
                raise ConfigError(f"--init {init} is a {data['architecture']}, not a Decoder")
            return ModelConfig.from_dict(data["config"]).replace(**dropout_overrides(self.opts))
        if self.opts.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.opts.preset!r}; choose one of {', '.join(PRESETS)}")
        overrides: dict[str, Any] = {"kind": "decoder", "vocab_size": self.tokenizer.vocab_size,
                                     "pad_token_id": self.tokenizer.pad_id, "bos_token_id": self.tokenizer.bos_id,
                                     "eos_token_id": self.tokenizer.eos_id}
        if PRESETS[self.opts.preset].get("kind", "decoder") != "decoder":
            raise ConfigError(f"preset {self.opts.preset!r} is not a decoder; language modelling needs one "
                              f"(e.g. small, tiny, gpt2-small)")
        overrides.update(dropout_overrides(self.opts))
        if self.opts.context and self.opts.context > PRESETS[self.opts.preset]["max_seq_len"]:
            overrides["max_seq_len"] = self.opts.context  # learned positions: the table grows with the context
        return preset(self.opts.preset, **overrides)

    # --- the protocol ------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        from ..model.models import Decoder

        model = Decoder(self.cfg)
        if self.init is not None:
            from ..checkpoints.adapter import merged
            from ..checkpoints.format import load

            model.load_state_dict(merged(load(self.init), self.init).state_dict())   # a LoRA run: base + adapter
        return model

    def batch(self, step: int, split: str = "train") -> dict[str, Tensor]:
        ids = self.train_ids if split == "train" else self.val_ids
        x, y = lm_batch(ids, self.batch_size, self.context, self.seed, step)
        return {"input_ids": x, "labels": y}

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return model(batch["input_ids"], labels=batch["labels"])   # cross-entropy, logits never whole (lm_loss.py)

    def tokens(self, batch: dict[str, Tensor]) -> int:
        return batch["input_ids"].numel()

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"val_loss": mean_loss(model, self.val_ids, self.context)}

    def sample(self, model: nn.Module) -> str:
        return sample_text(model, self.tokenizer, self.prompt, seed=self.seed)   # TEXT_DEFAULTS, as `tformer generate`

    def meta(self) -> dict[str, Any]:
        return {"data": str(self.opts.data), "tokenizer": self.tokenizer.kind, "context": self.context,
                **split_record(self.opts.val_fraction, self.test_fraction)}


def sample_text(model: nn.Module, tokenizer: Tokenizer, prompt: str,
                max_new_tokens: int = TEXT_DEFAULTS.max_new_tokens, temperature: float = TEXT_DEFAULTS.temperature,
                top_k: int | None = TEXT_DEFAULTS.top_k, top_p: float | None = TEXT_DEFAULTS.top_p,
                seed: int = 0) -> str:
    """Prompt + a sampled continuation, reproducible for a seed (the global RNG is not touched).
    Beyond the model's context it continues from the last half-context (generation.windowed).
    Defaults: sampled text's (generation.settings.TEXT_DEFAULTS), as `tformer generate`."""
    from ..generation import prompt_ids, windowed
    from ..generation.sampling import make_generator

    ids = prompt_ids(tokenizer, prompt)
    g = make_generator(seed, next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        new = [int(step[0]) for step in windowed(model, ids, max_new_tokens, do_sample=True, temperature=temperature,
                                                  top_k=top_k, top_p=top_p, generator=g)]
    finally:
        model.train(was_training)
    return tokenizer.decode(ids + new)
