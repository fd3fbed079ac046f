"""The model a server serves: the checkpoint, its tokenizers and chat template, and the one-shot
work of encoders (embeddings, labels). Decoding goes through the Scheduler instead."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoints.format import load, load_draft, load_source_tokenizer, load_tokenizer, read_config, resolve
from ..data.chat import template_reader
from ..data.chat_template import ChatTemplate, find_chat_template
from ..errors import ConfigError
from ..evaluation.batching import length_batches, pad
from ..evaluation.classify import encode_texts, predict_proba
from ..generation.settings import eos_ids
from ..model.plans import plan_encoding
from ..model.pooling import POOLINGS
from .adapters import Adapters

ENCODER_BATCH = 32          # texts per forward pass of an encoder
mean_tokens = POOLINGS["mean"]  # the pooling sentence-transformers models were trained with


class InputError(ValueError):
    """A request the model cannot take (too long, empty, no chat template): HTTP 400, `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class OutputText:
    """Decodes generated tokens as OpenAI-style servers do: without special tokens of any kind (a
    chat model's "<|start|>" too, not only the pad/BOS/EOS that tformer's Tokenizer.decode drops)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids) -> str:
        ids = [i for i in ids if i not in self.tokenizer.special_ids]
        return self.tokenizer.hf.decode(ids, skip_special_tokens=True)


class Served:
    def __init__(self, path: str, name: str | None = None, device: str | None = None, adapters: list[str] = (),
                 draft: str | None = None, dtype: torch.dtype | None = None):
        directory = resolve(path)
        self.model = load(directory, device)
        self.name = name or Path(path).resolve().name
        self.adapters = Adapters(self.name)                  # --adapter NAME=RUN: LoRA adapters, chosen per request
        self.adapters.load(self.model, directory, list(adapters))
        if dtype is not None:                                # --dtype bf16: the base and its adapters
            self.model.to(dtype)
        self.kind = self.model.kind
        cfg = self.model.cfg
        self.context = cfg.max_seq_len
        self.tokenizer = load_tokenizer(directory)
        # --draft-model: a small decoder with the same tokenizer drafting for speculative decoding (speculation.py)
        self.draft = load_draft(draft, self.tokenizer, cfg.max_seq_len, device, dtype) if draft is not None else None
        self.source_tokenizer = load_source_tokenizer(directory) or self.tokenizer
        self.output = OutputText(self.tokenizer)
        self.chat: ChatTemplate | None = find_chat_template(directory)
        meta = read_config(directory).get("meta", {})
        self.labels = None
        if self.kind == "classifier":
            self.labels = self.model.labels or meta.get("labels") or [str(i) for i in range(self.model.num_labels)]
            self.context = min(int(meta.get("max_len", self.context)), self.context)
        self.eos = set(eos_ids(self.model))                   # the rule generate() follows
        try:                                                 # the first decoder input of an encoder-decoder
            self.start = cfg.decoder_start()
        except ConfigError:
            self.start = None                                # each completion request answers 400
        self._special_reader = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- prompts ---------------------------------------------------------------------------------
    def prompt_ids(self, text: str, param: str = "prompt") -> list[int]:
        """A completion prompt -> token ids: the decoder's prompt, or an encoder-decoder's source (+ EOS,
        as translators are trained)."""
        reader = self.source_tokenizer
        ids = reader.encode(text)
        if self.model.is_encoder_decoder:
            ids = ids + ([reader.eos_id] if reader.eos_id is not None else [])
        elif not ids and reader.bos_id is not None:
            ids = [reader.bos_id]
        if not ids:
            raise InputError("the prompt is empty and the tokenizer has no BOS token to start from", param)
        if len(ids) > self.context:
            raise InputError(f"the prompt has {len(ids)} tokens but the model's context is {self.context} tokens",
                             param)
        return ids

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if self.chat is None:
            raise InputError(f"the model {self.name!r} has no chat template (use /v1/completions)", "messages")
        try:
            text = self.chat.render(messages, tools=tools)
        except ValueError as e:               # the template refused the conversation (raise_exception)
            raise InputError(str(e), "messages") from None
        ids = self._special_tokens_reader().encode(text, add_special_tokens=False).ids
        if len(ids) > self.context:
            raise InputError(f"the messages take {len(ids)} tokens but the model's context is {self.context} "
                             "tokens", "messages")
        return ids

    def _special_tokens_reader(self):
        """A copy of the tokenizer that reads special tokens in text ("<|eot_id|>"): chat templates
        write them. (tformer's Tokenizer never does, so user text cannot forge them.)"""
        if self._special_reader is None:
            self._special_reader = template_reader(self.tokenizer)
        return self._special_reader

    def check_budget(self, prompt_len: int, max_tokens: int) -> None:
        """The prompt plus max_tokens must fit the context: the KV cache pool holds no more."""
        target_len = 1 if self.model.is_encoder_decoder else prompt_len  # an encoder-decoder's target starts at 1 token
        if target_len + max_tokens > self.context:
            raise InputError(f"max_tokens={max_tokens} plus the prompt's {target_len} tokens exceeds the model's "
                             f"context of {self.context} tokens (use max_tokens <= {self.context - target_len})",
                             "max_tokens")

    # --- encoders --------------------------------------------------------------------------------
    def _encoder_inputs(self, texts: list[str]) -> list[list[int]]:
        seqs, _ = encode_texts(self.tokenizer, texts, max_len=1 << 62)        # [bos] + ids + [eos], uncut
        for i, s in enumerate(seqs):
            if len(s) > self.context:
                raise InputError(f"input {i} has {len(s)} tokens but the model's context is {self.context} tokens",
                                 "input")
        return seqs

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> tuple[torch.Tensor, int]:
        """Mean of the real tokens' vectors, unit length (sentence-transformers' recipe): (N, D), tokens."""
        seqs = self._encoder_inputs(texts)
        plan_encoding(self.model)                                        # once: oneDNN's packed weights
        out = torch.empty(len(seqs), self.model.cfg.d_model)
        pad_id = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        for rows in length_batches([len(s) for s in seqs], ENCODER_BATCH):
            ids, mask = pad([seqs[i] for i in rows], pad_id)
            ids, mask = ids.to(self.device), mask.to(self.device)
            out[rows] = F.normalize(mean_tokens(self.model(ids, mask), mask).float(), dim=-1).cpu()
        return out, sum(map(len, seqs))

    def classify(self, texts: list[str]) -> tuple[torch.Tensor, int]:
        """Label probabilities (N, labels) and the number of tokens read."""
        seqs = self._encoder_inputs(texts)
        plan_encoding(self.model)
        return predict_proba(self.model, self.tokenizer, texts, self.context, ENCODER_BATCH), sum(map(len, seqs))
