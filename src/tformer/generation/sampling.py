"""The token choice and the random generator, once for every caller: generate() / stream() and beam
search (this package) and the server's scheduler (serve/scheduler.py).

    logits (N, V) -> process_logits -> choose(processed, do_sample, generator, raw=logits) -> tokens (N,)

The guard against non-finite logits (a model that overflowed, or extreme settings such as a
temperature or repetition penalty of 1e-300, whose logits overflow to inf):

  - NaN becomes -inf: a NaN is never chosen nor drawn;
  - +inf becomes the largest float: the overflowed tokens (the largest logits, the settings' limit)
    are taken (greedy: the first of them) or share the draw, rather than softmax giving NaN;
  - a row with nothing finite left (all -inf or NaN after processing) takes the argmax of its raw
    logits, the ones before processing (NaN counting as the largest, as in greedy()), and draws
    nothing from the generator.

Logits without NaN or +inf (the filters' -inf included) pass unchanged, so a seed gives the tokens it
gave before the guard. Plain greedy decoding (no repetition penalty) does not come here: its fast
path (Stepper.next_greedy, the output layer's argmax) counts NaN as the largest, as greedy() does;
an all-NaN row gives token 0 there as here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .processors import NEG_INF, greedy, sample


def make_generator(seed: int | None, device=None) -> torch.Generator:
    """A torch.Generator on `device`, seeded with `seed`; seed None: a fresh non-deterministic seed.
    torch's global RNG is never touched."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def screen(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(N, V) -> the logits with NaN -> -inf and +inf -> the largest float, and (N,) bool: the rows
    with a finite logit left."""
    x = torch.nan_to_num(logits, nan=NEG_INF, posinf=torch.finfo(logits.dtype).max, neginf=NEG_INF)
    return x, x.amax(dim=-1) > NEG_INF             # no NaN or +inf is left; far cheaper than isfinite().any()


def choose(logits: Tensor, do_sample: bool, generator: torch.Generator | None = None,
           raw: Tensor | None = None) -> Tensor:
    """(N, V) processed logits -> (N,) tokens: the argmax of each row, or (do_sample) one draw per row
    from softmax(logits) with `generator`; guarded as the module docstring says. `raw`: the logits
    before processing, for rows with nothing finite left (default: `logits` itself)."""
    x, ok = screen(logits)
    raw = logits if raw is None else raw
    if not do_sample:
        return torch.where(ok, greedy(x), greedy(raw))          # no host sync when greedy
    if bool(ok.all()):        # a sync, but multinomial makes two of its own (its argument checks)
        return sample(x, generator)
    tokens = greedy(raw)
    if bool(ok.any()):
        tokens[ok] = sample(x[ok], generator).to(tokens.device)
    return tokens


def guarded(logits: Tensor) -> Tensor:
    """The guard for callers that score every token rather than choose one (beam search): NaN -> -inf,
    +inf -> the largest float, and a row with nothing finite left becomes certain of the token
    choose() would take there (0 at the argmax of `logits`, -inf elsewhere). Finite rows: unchanged."""
    x, ok = screen(logits)
    certain = torch.full_like(x, NEG_INF).scatter_(-1, greedy(logits).to(x.device)[:, None], 0.0)
    return torch.where(ok[:, None], x, certain)
