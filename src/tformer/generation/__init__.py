"""Generation: turn a model's next-token logits into text, one token at a time.

    processors.py  temperature, top-k, top-p, min-p, repetition penalty, greedy, sample (pure functions)
    sampling.py    choose (greedy or sampled, guarded against NaN / inf logits) and make_generator, for
                   every caller: generate(), beam search, the server
    stopping.py    stop sequences (overlaps handled), stop strings, TextStream (UTF-8-safe increments)
    settings.py    generate()'s arguments, checked once (Hugging Face's names and defaults), and every
                   caller's decoding defaults (DEFAULTS, TEXT_DEFAULTS, OPENAI_DEFAULTS)
    stepper.py     one model.step per generation step: prefill + one-token decode with the KV cache
    prepare.py     before the first step: the encoder run once, or left padding; rows repeated
    decoding.py    generate() / stream(): the greedy and sampling loop
    beam.py        beam search with Hugging Face's semantics
    speculative.py speculative decoding: drafts checked k at a time in one model step (one sequence)
    drafts.py      its drafts: a smaller decoder (ModelDraft) or n-grams of the text itself (PromptLookup)
    text.py        text in, text out: stream_text, the EOS and empty-prompt rules, writing past the context

Generation reaches a model only through `model.step`, `model.encode`, `model.new_cache`,
`model.cfg` and `model.is_encoder_decoder`. `Decoder` and `EncoderDecoder` have
`model.generate(...)` / `model.stream(...)`, which call these functions.
"""

from __future__ import annotations

from .decoding import generate, stream
from .processors import (
    apply_repetition_penalty,
    apply_temperature,
    greedy,
    min_p_filter,
    process_logits,
    sample,
    top_k_filter,
    top_p_filter,
)
from .sampling import choose, make_generator
from .settings import DEFAULTS, OPENAI_DEFAULTS, TEXT_DEFAULTS, eos_ids
from .speculative import SpeculativeStats
from .stopping import TextStream, sequence_hits
from .text import prompt_ids, stream_text, text_pieces, windowed

__all__ = [
    "generate", "stream", "stream_text", "text_pieces", "windowed", "eos_ids", "prompt_ids", "TextStream",
    "sequence_hits", "SpeculativeStats",
    "apply_repetition_penalty", "apply_temperature", "top_k_filter", "top_p_filter", "min_p_filter",
    "process_logits", "greedy", "sample", "choose", "make_generator", "DEFAULTS", "TEXT_DEFAULTS", "OPENAI_DEFAULTS",
]
