"""generate(): prompt in, prompt + new tokens out, with Hugging Face's argument names and meanings.

    ids = model.generate(input_ids, max_new_tokens=50, do_sample=True, temperature=0.8, top_k=50,
                         top_p=0.95, generator=torch.Generator().manual_seed(0))

Decoder: input_ids (B, T) is the prompt (left-padded with attention_mask when lengths differ);
returns (B, T + T_new). EncoderDecoder: input_ids is the source; the encoder runs once and the
target starts from the decoder start token; returns (B, 1 + T_new). Rows that finish early (EOS
or a stop sequence) are padded with pad_token_id; the result is as long as the longest row.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import Tensor

from ..errors import ConfigError
from ..model.plans import plan_decoding
from .beam import beam_search
from .prepare import Prepared, prepare
from .processors import process_logits
from .sampling import choose, make_generator
from .settings import Settings, make_settings
from .speculative import SpeculativeStats, make_speculation, speculative_steps
from .stopping import sequence_hits, string_hits


def sample_steps(p: Prepared, s: Settings, generator: torch.Generator | None) -> Iterator[Tensor]:
    """Greedy or sampled decoding, one token per row per step. Yields the new tokens (N,); when
    done, p.seqs[:, :p.prompt_len + steps] holds the result (the loop returns `steps`)."""
    seqs, t0 = p.seqs, p.prompt_len
    eos = torch.tensor(s.eos_token_id, device=seqs.device) if s.eos_token_id else None
    stops = [torch.tensor(q, device=seqs.device) for q in s.stop_sequences]
    check_stop = eos is not None or stops or s.stop_strings
    unfinished = torch.ones(seqs.size(0), dtype=torch.bool, device=seqs.device)
    do_greedy = s.greedy
    plain_greedy = do_greedy and (s.repetition_penalty == 1.0 or p.seen is None)   # argmax of the raw logits
    for step in range(s.max_new_tokens):
        cur = t0 + step
        if plain_greedy:
            tokens = p.stepper.next_greedy(seqs, cur)                           # (N,)
        else:
            logits = p.stepper.next_logits(seqs, cur).float()                   # (N, V)
            processed = process_logits(logits, p.seen, do_sample=not do_greedy, temperature=s.temperature,
                                       top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                       repetition_penalty=s.repetition_penalty)
            tokens = choose(processed, not do_greedy, generator, raw=logits)    # (N,), NaN / inf guarded
        if check_stop:
            tokens = torch.where(unfinished, tokens, s.pad_token_id)
        seqs[:, cur] = tokens
        if p.seen is not None:
            p.seen[torch.arange(seqs.size(0), device=seqs.device), tokens] = True
        yield tokens
        if check_stop:
            hit = torch.isin(tokens, eos) if eos is not None else torch.zeros_like(unfinished)
            if stops:
                hit |= sequence_hits(seqs[:, t0:cur + 1], stops)
            if s.stop_strings:
                rows = seqs[:, t0:cur + 1].tolist()
                hit |= torch.tensor(string_hits(s.tokenizer, rows, s.stop_strings), device=seqs.device)
            unfinished &= ~hit
            if not bool(unfinished.any()):                                      # the one sync per step
                return step + 1
    return s.max_new_tokens


def _run(steps: Iterator[Tensor], streamer: Callable[[Tensor], None] | None) -> int:
    while True:
        try:
            tokens = next(steps)
        except StopIteration as done:
            return done.value
        if streamer is not None:
            streamer(tokens)


def generate(model, input_ids: Tensor, attention_mask: Tensor | None = None, *, src_mask: Tensor | None = None,
             generator=None, seed=None, streamer: Callable[[Tensor], None] | None = None, draft_model=None,
             prompt_lookup: int | None = None, num_draft_tokens: int | None = None,
             speculative_stats: SpeculativeStats | None = None, **kwargs) -> Tensor:
    """Continue `input_ids` (see the module docstring). Arguments as in HF `generate`:
    max_new_tokens, do_sample, temperature (0 = greedy), top_k, top_p, min_p, repetition_penalty,
    num_beams, length_penalty, early_stopping, num_return_sequences, eos_token_id, pad_token_id,
    stop_strings (+ tokenizer), use_cache; also stop_sequences (lists of token ids) and
    generator / seed for reproducible sampling (no global RNG is touched). `streamer(tokens)` is
    called with each step's new tokens (N,) (not with beam search, where tokens are not final).
    N = B * num_return_sequences; rows of one input are adjacent, as in HF. One difference from
    HF: repetition_penalty ignores the ids under left padding (HF penalises them too).
    An EncoderDecoder's source mask may be given as attention_mask (HF) or src_mask.
    Speculative decoding (speculative.py; a decoder, one prompt): draft_model (a smaller decoder with the
    same vocabulary) or prompt_lookup=N (drafts copied after the last N-gram's earlier occurrence) proposes
    num_draft_tokens per round (default 4); speculative_stats (a SpeculativeStats) counts the accepted ones."""
    attention_mask = _one_mask(attention_mask, src_mask)
    s = make_settings(model, **kwargs)
    spec = make_speculation(model, s, input_ids, attention_mask, draft_model, prompt_lookup, num_draft_tokens,
                            speculative_stats)
    generator = _generator(generator, seed, input_ids.device) if s.do_sample else None
    plan_decoding(model, input_ids.size(0) * max(s.num_beams, s.num_return_sequences))
    with torch.inference_mode():
        if s.num_beams > 1:
            if streamer is not None:
                raise ConfigError("streamer cannot be used with num_beams > 1 (beams are only final at the end)")
            p = prepare(model, input_ids, attention_mask, s, s.num_beams)
            return beam_search(p, s, input_ids.size(0), generator)
        p = prepare(model, input_ids, attention_mask, s, s.num_return_sequences)
        loop = speculative_steps(p, s, spec, generator) if spec is not None else sample_steps(p, s, generator)
        steps = _run(loop, streamer)
        return p.seqs[:, :p.prompt_len + steps]


def stream(model, input_ids: Tensor, attention_mask: Tensor | None = None, *, src_mask: Tensor | None = None,
           generator=None, seed=None, draft_model=None, prompt_lookup: int | None = None,
           num_draft_tokens: int | None = None, speculative_stats: SpeculativeStats | None = None,
           **kwargs) -> Iterator[Tensor]:
    """Like generate(), but an iterator over the new tokens (N,) of each step, as they are made
    (speculative decoding: one token per item too)."""
    attention_mask = _one_mask(attention_mask, src_mask)
    s = make_settings(model, **kwargs)
    spec = make_speculation(model, s, input_ids, attention_mask, draft_model, prompt_lookup, num_draft_tokens,
                            speculative_stats)
    if s.num_beams > 1:
        raise ConfigError("num_beams > 1 cannot be streamed (beams are only final at the end); use generate()")
    plan_decoding(model, input_ids.size(0) * s.num_return_sequences)
    with torch.inference_mode():
        p = prepare(model, input_ids, attention_mask, s, s.num_return_sequences)
    generator = _generator(generator, seed, input_ids.device)
    return _inference(speculative_steps(p, s, spec, generator) if spec is not None else sample_steps(p, s, generator))


def _one_mask(attention_mask: Tensor | None, src_mask: Tensor | None) -> Tensor | None:
    if attention_mask is not None and src_mask is not None:
        raise ConfigError("give the source mask once: attention_mask or src_mask, not both")
    return attention_mask if attention_mask is not None else src_mask


def _inference(steps: Iterator[Tensor]) -> Iterator[Tensor]:
    """Run each step of a generator under inference_mode (the caller's code in between is not)."""
    while True:
        with torch.inference_mode():
            tokens = next(steps, None)
        if tokens is None:
            return
        yield tokens


def _generator(generator: torch.Generator | None, seed: int | None, device) -> torch.Generator:
    return generator if generator is not None else make_generator(seed, device)
