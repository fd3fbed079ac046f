"""Before the first step: the encoder run once (encoder-decoder) or the left-padded prompt (decoder),
every row repeated for beams or samples, the output buffer, and the Stepper that feeds the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError
from .settings import Settings
from .stepper import Stepper


def check_length(model, prompt_len: int, s: Settings, what: str) -> None:
    limit = model.cfg.max_seq_len
    if prompt_len > limit:
        raise ConfigError(f"{what} has {prompt_len} tokens but the model's context is max_seq_len={limit} "
                          f"(shorten it)")
    if prompt_len + s.max_new_tokens > limit:
        raise ConfigError(f"max_new_tokens={s.max_new_tokens} plus the {prompt_len} tokens of {what} exceeds the "
                          f"model's context max_seq_len={limit} (use max_new_tokens <= {limit - prompt_len} "
                          f"or a shorter prompt)")


@dataclass
class Prepared:
    """Everything the search loops need: the first columns of the sequences and a Stepper."""
    seqs: Tensor          # (N, prompt_len + max_new_tokens), filled with pad after the prompt
    prompt_len: int
    stepper: Stepper
    seen: Tensor | None   # (N, V) bool: tokens present, for the repetition penalty


def prepare(model, input_ids: Tensor, attention_mask: Tensor | None, s: Settings, copies: int) -> Prepared:
    """Run the encoder (once) or set up left padding, and repeat every row `copies` times
    (beams or num_return_sequences)."""
    if input_ids.dim() != 2:
        raise ConfigError(f"input_ids must have shape (batch, length), got {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ConfigError(f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape "
                          f"{tuple(input_ids.shape)}")
    cfg, device = model.cfg, input_ids.device
    memory = src_mask = None
    if model.is_encoder_decoder:
        if input_ids.size(1) > cfg.max_seq_len:
            raise ConfigError(f"the source (input_ids) has {input_ids.size(1)} tokens but the model's context is "
                              f"max_seq_len={cfg.max_seq_len} (shorten it)")
        start = cfg.decoder_start()
        # (B, S, D), once per source: the `copies` rows of a source share it (cross-attention folds them)
        memory, src_mask = model.encode(input_ids, attention_mask), attention_mask
        prompt = torch.full((input_ids.size(0) * copies, 1), start, dtype=torch.long, device=device)
        attention_mask = None
    else:
        prompt = input_ids.repeat_interleave(copies, dim=0)                                   # (N, T)
        if attention_mask is not None:
            if bool(attention_mask.all()):
                attention_mask = None         # no padding: the fast path without masks
            else:
                attention_mask = attention_mask.repeat_interleave(copies, dim=0)
    n, t = prompt.shape
    check_length(model, t, s, "the prompt (input_ids)")
    max_len = t + s.max_new_tokens
    seqs = torch.full((n, max_len), s.pad_token_id, dtype=torch.long, device=device)
    seqs[:, :t] = prompt
    seen = None
    if s.repetition_penalty != 1.0:
        # Only real prompt tokens count (HF also penalises the ids under left padding).
        seen = torch.zeros(n, cfg.vocab_size, dtype=torch.bool, device=device)
        real = attention_mask.bool() if attention_mask is not None else torch.ones_like(prompt, dtype=torch.bool)
        rows = torch.arange(n, device=device)[:, None].expand_as(prompt)
        seen[rows[real], prompt[real]] = True
    stepper = Stepper(model, n, max_len, s.use_cache, attention_mask, memory, src_mask)
    return Prepared(seqs, t, stepper, seen)
