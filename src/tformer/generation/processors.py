r"""Logits processors: small pure functions over a batch of next-token logits (B, V).

Generation turns the logits at the last position into a distribution and picks a token:

    logits -> logit bias -> repetition penalty -> frequency / presence penalties
           -> temperature -> top-k -> top-p -> min-p -> softmax -> sample
                                                    \-> argmax (greedy)

The bias and the penalties act on greedy choices too (as OpenAI's API has them); the warpers from
the temperature on act only when sampling. A grammar's token mask (structured outputs: the server's
response_format) comes before all of them: `apply_token_mask` sets the tokens the grammar forbids to
-inf, so nothing after it can bring them back.

Each filter sets the logits of removed tokens to -inf, so softmax gives them probability 0.
Semantics (ties, "at least one token survives") equal Hugging Face's warpers of the same names;
the tests compare them on random logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Make tokens already in the sequence less likely (CTRL paper): a positive logit is divided by
    `penalty`, a negative one multiplied, so both move down when penalty > 1. seen: (B, V) bool."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def apply_frequency_presence(logits: Tensor, counts: Tensor, frequency_penalty: float | Tensor,
                             presence_penalty: float | Tensor) -> Tensor:
    """OpenAI's penalties: logits[t] - frequency_penalty * count[t] - presence_penalty * (count[t] > 0),
    counts (B, V) of each token among the tokens generated so far. Penalties are numbers, or (B, 1)
    tensors for a batch whose rows have their own (positive: less repetition; OpenAI allows -2..2)."""
    return logits - frequency_penalty * counts - presence_penalty * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: Tensor, bias: Tensor) -> Tensor:
    """OpenAI's logit_bias: add bias (B, V) or (1, V) (from logit_bias_tensor): -100 all but bans a
    token, +100 all but forces it."""
    return logits + bias


def logit_bias_tensor(bias: dict[int, float], vocab_size: int, device=None) -> Tensor:
    """{token id: bias} -> (1, V) float32, 0 for the tokens not named."""
    out = torch.zeros(1, vocab_size, device=device)
    if bias:
        ids = torch.tensor(list(bias), device=device)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"logit_bias names token ids outside 0..{vocab_size - 1}")
        out[0, ids] = torch.tensor(list(bias.values()), device=device)
    return out


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """A grammar library's packed token mask -> bool. bitmask (..., ceil(V / 32)) int32, bit j of word w
    set when token 32 w + j is allowed (the layout xgrammar and llguidance fill) -> (..., V) bool."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1                               # (..., W, 32)
    return allowed.flatten(-2)[..., :vocab_size].bool()


def apply_token_mask(logits: Tensor, allowed: Tensor) -> Tensor:
    """Keep only the allowed tokens: logits (B, V), allowed (B, V) or (1, V) bool -> the others -inf.
    (torch.where: no negated copy of the mask, as masked_fill(~allowed) would make.)"""
    return torch.where(allowed, logits, NEG_INF)


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """softmax(z / t): t < 1 sharpens the distribution towards the top token, t > 1 flattens it."""
    return logits / temperature


def top_k_filter(logits: Tensor, k: int, min_tokens_to_keep: int = 1) -> Tensor:
    """Keep the k highest logits. Tokens tied with the k-th value are kept too (as in HF)."""
    k = min(max(k, min_tokens_to_keep), logits.size(-1))
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]                        # (B, 1)
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p_filter(logits: Tensor, p: float, min_tokens_to_keep: int = 1) -> Tensor:
    """Nucleus sampling: keep the smallest set of most likely tokens whose probability reaches p.

    Sorting ascending, a token is dropped when the probability mass up to and including it is
    <= 1 - p: the tokens left above it still hold at least p. The most likely token always stays."""
    sorted_logits, order = torch.sort(logits, descending=False, dim=-1)        # (B, V) ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= (1 - p)
    drop_sorted[..., -min_tokens_to_keep:] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)                           # back to vocabulary order
    return logits.masked_fill(drop, NEG_INF)


def min_p_filter(logits: Tensor, min_p: float, min_tokens_to_keep: int = 1) -> Tensor:
    """Keep tokens whose probability is at least min_p times the top token's probability."""
    probs = logits.softmax(dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    keep = torch.topk(probs, min(min_tokens_to_keep, probs.size(-1)), dim=-1).indices
    drop.scatter_(-1, keep, False)
    return logits.masked_fill(drop, NEG_INF)


def greedy(logits: Tensor) -> Tensor:
    """(B, V) -> (B,) the most likely token of each row (the first of equals; NaN counts as the
    largest). fp32 on the CPU goes through NumPy, whose argmax is several times faster than PyTorch's
    over a vocabulary's logits (BENCHMARKS.md, "Kernels"), with the same rule."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(logits.contiguous().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def sample(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """(B, V) -> (B,) one token per row drawn from softmax(logits), using `generator` only."""
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def process_logits(logits: Tensor, seen: Tensor | None = None, *, do_sample: bool = False,
                   temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
                   min_p: float | None = None, repetition_penalty: float = 1.0,
                   min_tokens_to_keep: int = 1, logit_bias: Tensor | None = None, counts: Tensor | None = None,
                   frequency_penalty: float | Tensor = 0.0, presence_penalty: float | Tensor = 0.0) -> Tensor:
    """The whole chain, in HF's order (OpenAI's bias and penalties first). The warpers (temperature,
    top-k, top-p, min-p) only act when sampling; greedy and beam search only see the bias and the
    penalties. logit_bias: (B or 1, V), from logit_bias_tensor; counts: (B, V) of the tokens generated
    so far, given when the frequency or presence penalty (numbers, or (B, 1) per row) is on. With every
    default, the logits pass unchanged."""
    if logit_bias is not None:
        logits = apply_logit_bias(logits, logit_bias)
    if repetition_penalty != 1.0 and seen is not None:
        logits = apply_repetition_penalty(logits, seen, repetition_penalty)
    if counts is not None:
        logits = apply_frequency_presence(logits, counts, frequency_penalty, presence_penalty)
    if not do_sample:
        return logits
    if temperature != 1.0:
        logits = apply_temperature(logits, temperature)
    if top_k and top_k < logits.size(-1):
        logits = top_k_filter(logits, top_k, min_tokens_to_keep)
    if top_p < 1.0:
        logits = top_p_filter(logits, top_p, min_tokens_to_keep)
    if min_p is not None and min_p > 0:
        logits = min_p_filter(logits, min_p, min_tokens_to_keep)
    return logits
