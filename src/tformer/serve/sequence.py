"""One choice being generated (a Sequence), its settings (Sampling) and what it sends its request
(Events): the per-row half of the scheduler. Each row processes its own logits with its own
settings and its own torch.Generator (and, for structured outputs, its own grammar matcher: the
token mask of the row's grammar, advanced by each token it takes), so rows with different settings
share a batch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..generation import TextStream, process_logits
from ..generation.processors import apply_token_mask, logit_bias_tensor
from ..generation.sampling import choose, make_generator
from ..generation.settings import OPENAI_DEFAULTS as OPENAI


@dataclass
class Sampling:
    """One choice's decoding settings (OpenAI's names; tformer's top_k, min_p, repetition_penalty);
    defaults: OpenAI's (generation.settings.OPENAI_DEFAULTS), as the request schema's."""
    max_tokens: int
    temperature: float = OPENAI.temperature    # 0: greedy
    top_p: float = OPENAI.top_p
    top_k: int | None = OPENAI.top_k
    min_p: float | None = OPENAI.min_p
    repetition_penalty: float = OPENAI.repetition_penalty
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None        # how many alternatives to report per token (None: no logprobs)
    frequency_penalty: float = 0.0     # OpenAI's: minus this x the token's count among the generated ones
    presence_penalty: float = 0.0      # OpenAI's: minus this once a token has been generated
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    prompt_logprobs: bool = False      # echo + logprobs: report the prompt's tokens too (the first: None)
    grammar: object | None = None      # structured outputs: a grammar.Compiled the text must follow


@dataclass
class Token:
    """One token, for logprobs: its text, log-probability, and the top alternatives (text, log-probability)
    with their ids (a prompt's first token: None, None: nothing predicts it)."""
    id: int
    text: str
    logprob: float | None
    top: list[tuple[str, float]] | None
    top_ids: list[int] | None = None


@dataclass
class Event:
    """What the loop sends a request: new text of choice `index`, and at the end a finish_reason
    ("stop", "length") or an error message. The first event carries the prompt's tokens when
    Sampling.prompt_logprobs asks for them."""
    index: int
    text: str = ""
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prompt: list[Token] | None = None


def token_info(tokenizer, token: int, logp: Tensor, top: int) -> Token:
    """Token `token` under log-probabilities logp (V,), with the `top` most likely alternatives."""
    best = torch.topk(logp, min(top, logp.numel())) if top else None
    ids = [] if best is None else best.indices.tolist()
    alternatives = [] if best is None else [(tokenizer.decode([i]), float(v)) for v, i in zip(best.values, ids)]
    return Token(token, tokenizer.decode([token]), float(logp[token]), alternatives, ids)


class Sequence:
    """One choice being generated: its prompt, settings, adapter, random generator, text and progress."""

    def __init__(self, index: int, prompt: list[int], sampling: Sampling, tokenizer, eos: set[int],
                 sink: Callable[[Event], None], source: list[int] | None = None, device=None, adapter: int = 0):
        self.index, self.prompt, self.source, self.s = index, prompt, source, sampling
        self.adapter = adapter              # the LoRA adapter its rows use (0: the base; serve/adapters.py)
        self.tokenizer, self.eos, self.sink = tokenizer, eos, sink
        self.text = TextStream(tokenizer, sampling.stop)
        self.generator = make_generator(sampling.seed, device) if sampling.temperature > 0 else None
        self.seen: Tensor | None = None     # (1, V) tokens present, for the repetition penalty
        self.counts: Tensor | None = None   # (1, V) generated tokens counted, for frequency / presence
        self.bias: Tensor | None = None     # (1, V) logit_bias
        self.prompt_tokens: list[Token] | None = None     # the prompt's logprobs, while prefilling
        self.matcher = sampling.grammar.matcher() if sampling.grammar is not None else None   # this row's place
        self.generated: list[int] = []
        self.cancelled = self.done = False
        self.cache = self.memory = None     # while prefilling: its own batch-1 cache (and encoder output)
        self.fed = 0
        self.keys: list[bytes] = []         # its prompt's chain of block keys in the prefix cache
        self.submitted = self.last_time = time.perf_counter()

    def process(self, logits: Tensor) -> Tensor:
        """logits (1, V) -> processed by this sequence's settings (generation.processors' chain)."""
        s = self.s
        if s.repetition_penalty != 1.0 and self.seen is None:
            self.seen = torch.zeros_like(logits, dtype=torch.bool)
            self.seen[0, torch.tensor(self.prompt, device=logits.device)] = True
        if (s.frequency_penalty or s.presence_penalty) and self.counts is None:
            self.counts = torch.zeros_like(logits)
        if s.logit_bias and self.bias is None:
            self.bias = logit_bias_tensor(s.logit_bias, logits.size(-1), logits.device)
        return process_logits(logits, self.seen, do_sample=s.temperature > 0, temperature=s.temperature,
                              top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, repetition_penalty=s.repetition_penalty,
                              logit_bias=self.bias, counts=self.counts, frequency_penalty=s.frequency_penalty,
                              presence_penalty=s.presence_penalty)

    def choose(self, logits: Tensor) -> int:
        """logits (V,) of the next token -> the token, by this sequence's settings and generator; with a
        grammar, only among the tokens it allows (the rest -inf before any other processing)."""
        logits = logits[None].float()                                             # (1, V)
        if self.matcher is not None:
            logits = apply_token_mask(logits, self.matcher.allowed(logits.device)[None])
        processed = self.process(logits)
        # generate()'s choice and guard: extreme settings (temperature 1e-300, penalty 1e-300) overflow
        # to inf, whose limit (the largest logits) is taken; a NaN is never drawn (generation.sampling)
        token = int(choose(processed, self.s.temperature > 0, self.generator, raw=logits)[0])
        if self.matcher is not None:
            self.matcher.accept(token)
        if self.seen is not None:
            self.seen[0, token] = True
        if self.counts is not None:
            self.counts[0, token] += 1
        return token

    def note_prompt(self, logits: Tensor, start: int) -> None:
        """Prompt logprobs from a prefill chunk's logits (T, V) at prompt positions start..start+T-1:
        position j predicts prompt token j + 1 (the chunk's last position, at the prompt's end,
        predicts the first generated token, which push() reports)."""
        if self.prompt_tokens is None:
            self.prompt_tokens = [Token(self.prompt[0], self.tokenizer.decode([self.prompt[0]]), None, None)]
        logp = logits.float().log_softmax(-1)                                     # (T, V)
        for j in range(min(logp.size(0), len(self.prompt) - 1 - start)):
            self.prompt_tokens.append(token_info(self.tokenizer, self.prompt[start + j + 1], logp[j],
                                                 self.s.logprobs or 0))

    def push(self, token: int, logits: Tensor, metrics) -> bool:
        """Record the new token, send its text; True when the sequence is finished (an EOS, a stop string,
        max_tokens, or its grammar complete)."""
        if self.matcher is not None and self.matcher.failed:     # no token of the vocabulary fits the grammar
            self.fail("the grammar allows no token of this model's vocabulary here")
            return True
        now = time.perf_counter()
        if metrics is not None:
            (metrics.ttft if not self.generated else metrics.itl).observe(
                now - (self.submitted if not self.generated else self.last_time))
            metrics.tokens_out.inc()
        self.last_time = now
        self.generated.append(token)
        info = [token_info(self.tokenizer, token, logits.float().log_softmax(-1), self.s.logprobs)] \
            if self.s.logprobs is not None else []
        event = Event(self.index, tokens=info, prompt=self.prompt_tokens)
        self.prompt_tokens = None                                                 # sent once, with the first token
        if token in self.eos:
            event.text, event.finish_reason = self.text.finish(), "stop"
        else:
            event.text = self.text.push([token])
            if self.text.stopped:
                event.finish_reason = "stop"
            elif self.matcher is not None and self.matcher.finished:   # its stop token (not the model's EOS)
                event.text += self.text.finish()
                event.finish_reason = "stop"
            elif len(self.generated) >= self.s.max_tokens:
                event.text += self.text.finish()
                event.finish_reason = "length"
        self.done = event.finish_reason is not None
        self.sink(event)
        return self.done

    def fail(self, message: str) -> None:
        if not self.done:
            self.done = True
            self.sink(Event(self.index, error=message))
