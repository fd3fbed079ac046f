"""generate(): prompt in, prompt + new tokens out, with Hugging Face's argument names and meanings.

    ids = model.generate(input_ids, max_new_tokens=50, do_sample=True, temperature=0.8, top_k=50,
                         top_p=0.95, generator=torch.Generator().manual_seed(0))

Decoder: input_ids (B, T) is the prompt (left-padded with attention_mask when lengths differ);
returns (B, T + T_new). EncoderDecoder: input_ids is the source; the encoder runs once and the
target starts from the decoder start token; returns (B, 1 + T_new). Rows that finish early (EOS
or a stop sequence) are padded with pad_token_id; the result is as long as the longest row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor

from ..errors import ConfigError
from ..linear import plan_decoding
from .processors import greedy, process_logits, sample
from .stepper import Stepper
from .stopping import sequence_hits, string_hits


@dataclass
class Settings:
    """The arguments of generate(), checked. Defaults are HF's."""
    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int = 0
    stop_sequences: list[list[int]] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    tokenizer: object = None
    use_cache: bool = True

    def check(self) -> None:
        def bad(name: str, why: str):
            raise ConfigError(f"{name}={getattr(self, name)!r} {why}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            bad("max_new_tokens", "must be an integer >= 0")
        if self.temperature is None or not self.temperature >= 0:  # `not >=` also refuses NaN
            bad("temperature", "must be >= 0 (0 means greedy)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            bad("top_k", "must be an integer >= 0 (0 or None turns top-k off)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1] (1 turns top-p off)")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be > 0 (1 turns it off)")
        if not isinstance(self.num_beams, int) or self.num_beams < 1:
            bad("num_beams", "must be an integer >= 1")
        if self.early_stopping not in (True, False, "never"):
            bad("early_stopping", "must be True, False or 'never'")
        if not isinstance(self.num_return_sequences, int) or self.num_return_sequences < 1:
            bad("num_return_sequences", "must be an integer >= 1")
        if self.num_beams > 1 and self.num_return_sequences > self.num_beams:
            bad("num_return_sequences", f"cannot exceed num_beams={self.num_beams}")
        if any(len(s) == 0 for s in self.stop_sequences):
            bad("stop_sequences", "must not contain an empty sequence")
        if self.stop_strings and self.tokenizer is None:
            bad("stop_strings", "need tokenizer=... to decode the generated tokens")

    @property
    def greedy(self) -> bool:
        """Sampling at temperature 0 is greedy decoding (the limit of softmax(z / t) as t -> 0)."""
        return not self.do_sample or self.temperature == 0


def _as_list(x) -> list:
    if x is None:
        return []
    return [x] if isinstance(x, int) else [int(i) for i in x]


def make_settings(model, *, max_new_tokens=20, do_sample=False, temperature=1.0, top_k=50, top_p=1.0,
                  min_p=None, repetition_penalty=1.0, num_beams=1, length_penalty=1.0, early_stopping=False,
                  num_return_sequences=1, eos_token_id=None, pad_token_id=None, stop_sequences=None,
                  stop_strings=None, tokenizer=None, use_cache=True) -> Settings:
    """eos_token_id / pad_token_id default to the model config's (pass eos_token_id=[] for none);
    finished rows are padded with pad_token_id, else the first EOS id, else 0."""
    cfg = model.cfg
    # None means "the default", as in HF (top_k=None: no top-k filter)
    temperature = 1.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p
    repetition_penalty = 1.0 if repetition_penalty is None else repetition_penalty
    length_penalty = 1.0 if length_penalty is None else length_penalty
    eos = _as_list(cfg.eos_token_id if eos_token_id is None else eos_token_id)
    pad = pad_token_id if pad_token_id is not None else cfg.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)
    s = Settings(max_new_tokens, do_sample, temperature, top_k, top_p, min_p, repetition_penalty, num_beams,
                 length_penalty, early_stopping, num_return_sequences, eos, pad,
                 [list(map(int, q)) for q in (stop_sequences or [])],
                 [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or []), tokenizer, use_cache)
    s.check()
    return s


def _check_length(model, prompt_len: int, s: Settings, what: str) -> None:
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
        memory = model.encode(input_ids, attention_mask).repeat_interleave(copies, dim=0)       # (N, S, D)
        if attention_mask is not None:
            src_mask = attention_mask.repeat_interleave(copies, dim=0)
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
    _check_length(model, t, s, "the prompt (input_ids)")
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


def sample_steps(p: Prepared, s: Settings, generator: torch.Generator | None) -> Iterator[Tensor]:
    """Greedy or sampled decoding, one token per row per step. Yields the new tokens (N,); when
    done, p.seqs[:, :p.prompt_len + steps] holds the result (the loop returns `steps`)."""
    seqs, t0 = p.seqs, p.prompt_len
    eos = torch.tensor(s.eos_token_id, device=seqs.device) if s.eos_token_id else None
    stops = [torch.tensor(q, device=seqs.device) for q in s.stop_sequences]
    check_stop = eos is not None or stops or s.stop_strings
    unfinished = torch.ones(seqs.size(0), dtype=torch.bool, device=seqs.device)
    do_greedy = s.greedy
    for step in range(s.max_new_tokens):
        cur = t0 + step
        logits = p.stepper.next_logits(seqs, cur).float()                       # (N, V)
        logits = process_logits(logits, p.seen, do_sample=not do_greedy, temperature=s.temperature,
                                top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                repetition_penalty=s.repetition_penalty)
        tokens = greedy(logits) if do_greedy else sample(logits, generator)     # (N,)
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
             generator=None, seed=None, streamer: Callable[[Tensor], None] | None = None, **kwargs) -> Tensor:
    """Continue `input_ids` (see the module docstring). Arguments as in HF `generate`:
    max_new_tokens, do_sample, temperature (0 = greedy), top_k, top_p, min_p, repetition_penalty,
    num_beams, length_penalty, early_stopping, num_return_sequences, eos_token_id, pad_token_id,
    stop_strings (+ tokenizer), use_cache; also stop_sequences (lists of token ids) and
    generator / seed for reproducible sampling (no global RNG is touched). `streamer(tokens)` is
    called with each step's new tokens (N,) (not with beam search, where tokens are not final).
    N = B * num_return_sequences; rows of one input are adjacent, as in HF. One difference from
    HF: repetition_penalty ignores the ids under left padding (HF penalises them too).
    An EncoderDecoder's source mask may be given as attention_mask (HF) or src_mask."""
    attention_mask = _one_mask(attention_mask, src_mask)
    s = make_settings(model, **kwargs)
    generator = _generator(generator, seed, input_ids.device) if s.do_sample else None
    plan_decoding(model, input_ids.size(0) * max(s.num_beams, s.num_return_sequences))
    with torch.inference_mode():
        if s.num_beams > 1:
            if streamer is not None:
                raise ConfigError("streamer cannot be used with num_beams > 1 (beams are only final at the end)")
            from .beam import beam_search
            p = prepare(model, input_ids, attention_mask, s, s.num_beams)
            return beam_search(p, s, input_ids.size(0), generator)
        p = prepare(model, input_ids, attention_mask, s, s.num_return_sequences)
        steps = _run(sample_steps(p, s, generator), streamer)
        return p.seqs[:, :p.prompt_len + steps]


def stream(model, input_ids: Tensor, attention_mask: Tensor | None = None, *, src_mask: Tensor | None = None,
           generator=None, seed=None, **kwargs) -> Iterator[Tensor]:
    """Like generate(), but an iterator over the new tokens (N,) of each step, as they are made."""
    attention_mask = _one_mask(attention_mask, src_mask)
    s = make_settings(model, **kwargs)
    if s.num_beams > 1:
        raise ConfigError("num_beams > 1 cannot be streamed (beams are only final at the end); use generate()")
    plan_decoding(model, input_ids.size(0) * s.num_return_sequences)
    with torch.inference_mode():
        p = prepare(model, input_ids, attention_mask, s, s.num_return_sequences)
    return _inference(sample_steps(p, s, _generator(generator, seed, input_ids.device)))


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
    if generator is not None:
        return generator
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()                     # fresh non-deterministic seed, without touching torch's global RNG
    else:
        g.manual_seed(seed)
    return g
