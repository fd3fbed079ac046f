"""Generation: turn a model's next-token logits into text, one token at a time.

    processors.py  temperature, top-k, top-p, min-p, repetition penalty, greedy, sample (pure functions)
    stopping.py    stop sequences (overlaps handled), stop strings, TextStream (UTF-8-safe increments)
    stepper.py     one forward per step: prefill + one-token decode with the KV cache, or recompute
    decoding.py    generate() / stream(): argument checks, left padding, greedy and sampling loop
    beam.py        beam search with Hugging Face's semantics

`Decoder` and `EncoderDecoder` have `model.generate(...)` / `model.stream(...)`, which call these.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

from .decoding import generate, stream
from .processors import (apply_repetition_penalty, apply_temperature, greedy, min_p_filter, process_logits,
                         sample, top_k_filter, top_p_filter)
from .stopping import TextStream, sequence_hits


def stream_text(model, tokenizer, prompt: str, *, stop_strings=(), include_stop: bool = False,
                sliding_window: bool = False, source_tokenizer=None, **kwargs) -> Iterator[str]:
    """Generate from one text prompt and yield the new text as it becomes complete (never half a
    UTF-8 character, never the start of a stop string that may still complete). For an
    EncoderDecoder the prompt is the source text (read by `source_tokenizer` when the source has
    its own vocabulary). Other arguments as in generate().

    sliding_window=True lets a Decoder write past its context (max_seq_len): when the context is
    full, generation restarts from the last half-context of tokens (as nanoGPT's sampler does)."""
    reader = source_tokenizer or tokenizer
    ids = reader.encode(prompt)
    if not ids and getattr(reader, "bos_id", None) is not None:
        ids = [reader.bos_id]
    if not ids:
        from ..errors import ConfigError
        raise ConfigError("the prompt is empty and the tokenizer has no BOS token to start from (give a prompt)")
    device = next(model.parameters()).device
    stop_strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
    max_new, context = kwargs.pop("max_new_tokens", 20), model.cfg.max_seq_len
    if sliding_window and not hasattr(model, "encode") and len(ids) < context < len(ids) + max_new:
        first = min(max_new, context - len(ids))
        steps = _windowed(model, ids, first, max_new, context, dict(stop_strings=stop_strings, tokenizer=tokenizer,
                                                                    **kwargs))
    else:
        steps = stream(model, torch.tensor([ids], device=device), stop_strings=stop_strings, tokenizer=tokenizer,
                       max_new_tokens=max_new, **kwargs)  # checks arguments now
    eos = set(_eos_ids(model, kwargs.get("eos_token_id")))
    return _text_pieces(steps, TextStream(tokenizer, stop_strings, include_stop), eos)


def _windowed(model, ids: list[int], first: int, max_new: int, context: int, kwargs: dict) -> Iterator[Tensor]:
    """Steps of stream() over successive windows: each round continues the last context // 2 tokens.
    The first round is created now, so its arguments are checked before any text is printed."""
    device = next(model.parameters()).device
    steps = stream(model, torch.tensor([ids], device=device), max_new_tokens=first, **kwargs)

    def rounds() -> Iterator[Tensor]:
        nonlocal steps
        tokens, remaining, n = list(ids), max_new, first
        while True:
            produced = 0
            for step in steps:
                produced += 1
                tokens.append(int(step[0]))
                yield step
            remaining -= produced
            if produced < n or remaining <= 0:  # stopped early (EOS, stop sequence) or done
                return
            window = tokens[-(context // 2):]
            n = min(remaining, context - len(window))
            steps = stream(model, torch.tensor([window], device=device), max_new_tokens=n, **kwargs)

    return rounds()


def _text_pieces(steps: Iterator[Tensor], text: TextStream, eos: set[int]) -> Iterator[str]:
    for tokens in steps:
        token = int(tokens[0])
        if token in eos:
            break
        piece = text.push([token])
        if piece:
            yield piece
        if text.stopped:
            break
    rest = text.finish()
    if rest:
        yield rest


def _eos_ids(model, eos_token_id) -> list[int]:
    eos = model.cfg.eos_token_id if eos_token_id is None else eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


__all__ = [
    "generate", "stream", "stream_text", "TextStream", "sequence_hits",
    "apply_repetition_penalty", "apply_temperature", "top_k_filter", "top_p_filter", "min_p_filter",
    "process_logits", "greedy", "sample",
]
