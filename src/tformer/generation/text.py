"""Text in, text out: one prompt through generate's steps, decoded as the tokens arrive.

The rules every text caller shares live here once: what a prompt becomes when it tokenizes to
nothing (prompt_ids) and how a decoder writes past its context (windowed: the nanoGPT sampler's
restart from the last half-context). Which ids end a text is settings.eos_ids.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

from ..errors import ConfigError
from .decoding import stream
from .settings import eos_ids
from .stopping import TextStream


def prompt_ids(tokenizer, text: str) -> list[int]:
    """`text` as token ids; an empty prompt starts from the tokenizer's BOS token."""
    ids = tokenizer.encode(text)
    if not ids and getattr(tokenizer, "bos_id", None) is not None:
        ids = [tokenizer.bos_id]
    if not ids:
        raise ConfigError("the prompt is empty and the tokenizer has no BOS token to start from (give a prompt)")
    return ids


def stream_text(model, tokenizer, prompt: str, *, stop_strings=(), include_stop: bool = False,
                sliding_window: bool = False, source_tokenizer=None, **kwargs) -> Iterator[str]:
    """Generate from one text prompt and yield the new text as it becomes complete (never half a
    UTF-8 character, never the start of a stop string that may still complete). For an
    EncoderDecoder the prompt is the source text (read by `source_tokenizer` when the source has
    its own vocabulary). Generation ends at eos_ids(model, eos_token_id, tokenizer). Other
    arguments as in generate(); sliding_window=True lets a Decoder write past its context (windowed),
    from a prompt that fits it."""
    ids = prompt_ids(source_tokenizer or tokenizer, prompt)
    stop_strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
    kwargs.update(stop_strings=stop_strings, tokenizer=tokenizer,
                  eos_token_id=eos_ids(model, kwargs.get("eos_token_id"), tokenizer))
    if sliding_window and not model.is_encoder_decoder and len(ids) < model.cfg.max_seq_len:
        steps = windowed(model, ids, **kwargs)
    else:
        steps = stream(model, torch.tensor([ids], device=_device(model)), **kwargs)  # checks arguments now
    return text_pieces(steps, TextStream(tokenizer, stop_strings, include_stop), set(kwargs["eos_token_id"]))


def windowed(model, ids: list[int], max_new_tokens: int = 20, **kwargs) -> Iterator[Tensor]:
    """The steps of stream() for one prompt, past a Decoder's context (max_seq_len): when the
    context is full, generation restarts from the last half-context of tokens (as nanoGPT's
    sampler does; learned positions do not extend further). A prompt longer than the context is
    cut to its last half-context. The first round is created now, so its arguments are checked
    before any text is printed."""
    context, device = model.cfg.max_seq_len, _device(model)
    window = ids if len(ids) < context else ids[-(context // 2):]
    n = min(max_new_tokens, context - len(window))
    steps = stream(model, torch.tensor([window], device=device), max_new_tokens=n, **kwargs)

    def rounds() -> Iterator[Tensor]:
        nonlocal steps, n
        tokens, remaining = list(window), max_new_tokens
        while True:
            produced = 0
            for step in steps:
                produced += 1
                tokens.append(int(step[0]))
                yield step
            remaining -= produced
            if produced < n or remaining <= 0:  # stopped early (EOS, stop sequence) or done
                return
            tokens = tokens[-(context // 2):]
            n = min(remaining, context - len(tokens))
            steps = stream(model, torch.tensor([tokens], device=device), max_new_tokens=n, **kwargs)

    return rounds()


def _device(model) -> torch.device:
    return next(model.parameters()).device


def text_pieces(steps: Iterator[Tensor], text: TextStream, eos: set[int]) -> Iterator[str]:
    """The text of one row's steps (from stream()), as `text` releases it, up to the first id in `eos`."""
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
