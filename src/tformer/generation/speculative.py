"""Speculative decoding: a cheap draft proposes k tokens and the model checks them all in one forward pass.

    generate(model, ids, draft_model=small, num_draft_tokens=4, speculative_stats=stats)
    generate(model, ids, prompt_lookup=3)              # drafts copied from the text itself (drafts.py)

One round, one sequence (batch size 1: each row would accept a different number of tokens):

    known:   x_1 .. x_c                       the model's cache holds x_1 .. x_(c-1)
    draft:   d_1 .. d_k                       (q_i: the draft's distribution for d_i; none: certain)
    model:   one step over [x_c, d_1 .. d_k]  -> p_0 .. p_k, the next-token distribution after each
    accept:  d_1 .. d_n, the longest run the rule below takes; then one token of the model's own,
             from p_n (at the first rejection: from norm(max(0, p_n - q_n)))
    caches:  both cut back to x_1 .. x_c, d_1 .. d_n (Cache.truncate); the new token is fed next round

Greedy: d_i is accepted while it equals the argmax of p_(i-1), so every token is the one plain greedy
decoding takes (the model's logits at a position do not depend on how many positions a step feeds, up
to float rounding: a near-tie may break the other way). Sampling (Leviathan et al. 2023; Chen et al.
2023): accept d_i with probability min(1, p(d_i) / q(d_i)), else draw from norm(max(0, p - q)); the
token is then distributed as p exactly, whatever q is. p and q are the processed distributions plain
decoding draws from (penalty, temperature, top-k, top-p, min-p: drafts.processed), the penalty's
`seen` set growing with the drafted tokens. A seed gives other text than plain sampling's: the draws differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor

from ..errors import ConfigError
from ..model.plans import plan_decoding
from .drafts import ModelDraft, PromptLookup, probabilities, processed, seen_rows
from .prepare import Prepared
from .sampling import choose
from .settings import Settings
from .stepper import greedy_tokens
from .stopping import sequence_hits, string_hits

DEFAULT_DRAFT_TOKENS = 4     # k: vLLM and HF's static schedule use 3-5 for a draft model


@dataclass
class SpeculativeStats:
    """What the drafts were worth, summed over every round (and every generate() given this object)."""
    proposed: int = 0     # draft tokens offered to the model
    accepted: int = 0     # of them, the ones it took
    rounds: int = 0       # the model's forward passes

    @property
    def acceptance(self) -> float:
        """accepted / proposed (0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed, self.accepted, self.rounds = self.proposed + proposed, self.accepted + accepted, self.rounds + 1


@dataclass
class Speculation:
    """Where the drafts come from (a model, or prompt lookup's n-gram length) and how many per round."""
    draft_model: object | None
    prompt_lookup: int | None
    k: int
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)

    def start(self, max_len: int) -> ModelDraft | PromptLookup:
        """The draft for one sequence of up to `max_len` tokens."""
        if self.draft_model is None:
            return PromptLookup(self.prompt_lookup)
        plan_decoding(self.draft_model, 1)
        return ModelDraft(self.draft_model, max_len)


def make_speculation(model, s: Settings, input_ids: Tensor, attention_mask: Tensor | None, draft_model=None,
                     prompt_lookup: int | None = None, num_draft_tokens: int | None = None,
                     stats: SpeculativeStats | None = None) -> Speculation | None:
    """generate()'s speculative arguments, checked (ConfigError naming the reason); None: plain decoding."""
    if draft_model is None and prompt_lookup is None:
        if num_draft_tokens is not None or stats is not None:
            raise ConfigError("num_draft_tokens and speculative_stats need a draft: draft_model=... or prompt_lookup=N")
        return None
    if draft_model is not None and prompt_lookup is not None:
        raise ConfigError("give draft_model or prompt_lookup, not both (one source of drafts)")
    k = DEFAULT_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens
    if not _positive_int(k):
        raise ConfigError(f"num_draft_tokens={k!r} must be an integer >= 1 (the tokens drafted per round)")
    if prompt_lookup is not None and not _positive_int(prompt_lookup):
        raise ConfigError(f"prompt_lookup={prompt_lookup!r} must be an integer >= 1 (the n-gram length matched)")
    why = _one_sequence(model, s, input_ids, attention_mask)
    if why:
        raise ConfigError(f"speculative decoding {why}")
    if draft_model is not None:
        _check_draft(model, draft_model, input_ids.size(1) + s.max_new_tokens)
    return Speculation(draft_model, prompt_lookup, k, stats if stats is not None else SpeculativeStats())


def _positive_int(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _one_sequence(model, s: Settings, input_ids: Tensor, attention_mask: Tensor | None) -> str | None:
    """Why this call is not one sequence of a decoder that speculative decoding can continue (None: it is)."""
    if model.is_encoder_decoder:
        return "is for decoders; the model is an encoder-decoder"
    if input_ids.dim() != 2 or input_ids.size(0) != 1:
        return f"takes one prompt (batch size 1), got input_ids of shape {tuple(input_ids.shape)}"
    if s.num_beams > 1:
        return f"does not combine with beam search (num_beams={s.num_beams}; use 1)"
    if s.num_return_sequences > 1:
        return f"makes one sequence (num_return_sequences={s.num_return_sequences}; use 1)"
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        return "takes an unpadded prompt (attention_mask has 0s)"
    if not s.use_cache:
        return "needs the KV cache (use_cache=True)"
    return None


def _check_draft(model, draft, length: int) -> None:
    if draft.kind != "decoder":
        raise ConfigError(f"draft_model is a {type(draft).__name__} ({draft.kind}); a draft must be a decoder")
    if draft.cfg.vocab_size != model.cfg.vocab_size:
        raise ConfigError(f"draft_model has vocab_size={draft.cfg.vocab_size} but the model {model.cfg.vocab_size}: "
                          f"a draft must share the model's tokenizer")
    if draft.cfg.max_seq_len < length:
        raise ConfigError(f"draft_model's context max_seq_len={draft.cfg.max_seq_len} is shorter than the prompt plus "
                          f"max_new_tokens ({length})")


def acceptance(p: Tensor, q: Tensor | None, drafted: Tensor) -> Tensor:
    """(m,) the probability of accepting each drafted token d_i: min(1, p_i(d_i) / q_i(d_i)); q None
    (a certain draft, q_i one-hot at d_i): p_i(d_i). p, q: (m, V)."""
    rows = torch.arange(drafted.numel(), device=p.device)
    p_d = p[rows, drafted]
    return p_d if q is None else (p_d / q[rows, drafted]).clamp(max=1.0)


def residual(p: Tensor, q: Tensor | None, token: int) -> Tensor:
    """(V,) the distribution to draw from after rejecting `token`: norm(max(0, p - q)); q None (one-hot
    at token): p without token, renormalised. p itself where nothing is left (only rounding rejected)."""
    if q is None:
        rest = p.clone()
        rest[token] = 0.0
    else:
        rest = (p - q).clamp(min=0.0)
    total = rest.sum()
    return rest / total if total > 0 else p


def _first_false(ok: Tensor) -> int:
    """The index of the first False in (m,) bool, m when all are True."""
    return int((~ok).int().argmax()) if not bool(ok.all()) else ok.numel()


def verify(model, cache, seqs: Tensor, cur: int, drafted: Tensor, q: Tensor | None, s: Settings, seen: Tensor | None,
           generator: torch.Generator | None) -> Tensor:
    """One model step over the unfed known tokens and the m drafted ones (seqs[:, :cur + m]) -> the round's
    new tokens (n + 1,): the n drafts accepted, then the model's own token."""
    m = drafted.numel()
    hidden = model.step(seqs[:, cache.length:cur + m], cache, all_logits=True, head=False)[0, -(m + 1):]  # (m+1, D)
    if s.greedy and (s.repetition_penalty == 1.0 or seen is None):
        choice = greedy_tokens(model, hidden)                                     # (m + 1,)
    else:
        logits = model.lm_head(hidden).float()                                   # (m + 1, V)
        x = processed(logits, seen_rows(seen, drafted), s)
        if s.greedy:
            choice = choose(x, False, raw=logits)
        else:
            p = probabilities(x, logits)
            taken = torch.rand(m, generator=generator, device=p.device) < acceptance(p[:m], q, drafted)
            n = _first_false(taken)
            last = residual(p[n], None if q is None else q[n], int(drafted[n])) if n < m else p[m]
            token = torch.multinomial(last, 1, generator=generator)
            return torch.cat([drafted[:n], token.to(drafted.device)])
    n = _first_false(drafted == choice[:m].to(drafted.device))
    return torch.cat([drafted[:n], choice[n:n + 1].to(drafted.device)])


def speculative_steps(p: Prepared, s: Settings, spec: Speculation,
                      generator: torch.Generator | None) -> Iterator[Tensor]:
    """generate()'s loop for one sequence, drafting: yields each new token (1,) as plain decoding's
    steps do; when done, p.seqs[:, :p.prompt_len + steps] holds the result (the loop returns `steps`)."""
    seqs, t0, end = p.seqs, p.prompt_len, p.seqs.size(1)
    model, cache = p.stepper.model, p.stepper.cache
    draft = spec.start(end)
    stops = [torch.tensor(q, device=seqs.device) for q in s.stop_sequences]
    check_stop = bool(s.eos_token_id or stops or s.stop_strings)
    cur = t0
    while cur < end:
        k = min(spec.k, end - cur - 1)                       # room for the drafts and the model's own token
        drafted, q = draft.propose(seqs, cur, k, s, p.seen, generator) if k else (seqs.new_empty(0), None)
        new = verify(model, cache, seqs, cur, drafted, q, s, p.seen, generator)
        n = new.numel() - 1
        spec.stats.record(drafted.numel(), n)
        cache.truncate(cur + n)                             # keep x_1 .. x_c, d_1 .. d_n
        draft.rewind(cur + n)
        for token in new.tolist():
            seqs[0, cur] = token
            if p.seen is not None:
                p.seen[0, token] = True
            cur += 1
            yield seqs[:, cur - 1].clone()
            if check_stop and _stopped(s, seqs[:, t0:cur], stops):
                return cur - t0
    return cur - t0


def _stopped(s: Settings, generated: Tensor, stops: list[Tensor]) -> bool:
    """Whether the generated tokens (1, T) end the text: EOS, a stop sequence, a stop string."""
    if int(generated[0, -1]) in s.eos_token_id:
        return True
    if stops and bool(sequence_hits(generated, stops)[0]):
        return True
    return bool(s.stop_strings) and string_hits(s.tokenizer, generated.tolist(), s.stop_strings)[0]
