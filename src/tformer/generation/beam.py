"""Beam search with Hugging Face's semantics (transformers >= 4.50 `_beam_search`).

Keep K = num_beams running hypotheses per input. Each step:

  1. score every (beam, next token) pair: running score + log p(token | beam)   -> (B, K*V)
  2. take the best 2K candidates (more when there are several EOS ids), so that K survive even
     if the best K all end here;
  3. candidates that end (EOS, stop sequence, or the length limit) compete for the K "finished"
     slots with score / new_length ** length_penalty; the best K that do not end run on;
  4. stop when no running beam can beat the worst finished one (early_stopping=False: judged at
     the current length; "never": at the longest length when length_penalty > 0; True: as soon as
     K hypotheses are finished).

Scores are log-probabilities, so the sum over a hypothesis is its log-likelihood. Arithmetic,
the -1e9 sentinels included, follows HF step by step so ties break the same way. Non-finite logits
get generate()'s guard (sampling.guarded): NaN is never a candidate, +inf is the largest float, and
a beam with nothing finite continues with the argmax of its logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .prepare import Prepared
from .processors import process_logits
from .sampling import guarded
from .settings import Settings
from .stopping import sequence_hits, string_hits

NEG = -1.0e9


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """x: (B, K, ...), index: (B, J) -> (B, J, ...): pick beams per input."""
    while index.dim() < x.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(x, index, dim=1)


def beam_search(p: Prepared, s: Settings, batch_size: int, generator: torch.Generator | None) -> Tensor:
    """Returns (B * num_return_sequences, T) best hypotheses, best first, padded with pad_token_id."""
    B, K, t0 = batch_size, s.num_beams, p.prompt_len
    max_len = p.seqs.size(1)
    device = p.seqs.device
    if s.max_new_tokens == 0:
        return p.seqs[::K][:, :t0].repeat_interleave(s.num_return_sequences, dim=0)
    keep = max(2, 1 + len(s.eos_token_id)) * K
    top_k_mask = torch.arange(keep, device=device) < K                           # (keep,)
    eos = torch.tensor(s.eos_token_id, device=device) if s.eos_token_id else None
    stops = [torch.tensor(q, device=device) for q in s.stop_sequences]
    sampling = s.do_sample and not s.greedy

    running = p.seqs.view(B, K, max_len).clone()                                 # (B, K, T_max)
    running_scores = torch.zeros(B, K, device=device)
    running_scores[:, 1:] = NEG            # all beams start equal: only beam 0 may expand at step 0
    finished = running.clone()
    finished_scores = torch.full((B, K), NEG, device=device)
    finished_len = torch.full((B, K), t0, device=device)
    is_finished = torch.zeros(B, K, dtype=torch.bool, device=device)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    seen = p.seen
    batch_offset = torch.arange(B, device=device)[:, None] * K                   # (B, 1)

    for cur in range(t0, max_len):
        logits = guarded(p.stepper.next_logits(running.view(B * K, max_len), cur).float())   # (B*K, V)

        # 1-2. the best `keep` continuations over all beams of each input
        if sampling or seen is not None:
            log_probs = torch.log_softmax(logits, dim=-1)
            log_probs = process_logits(log_probs, seen, do_sample=sampling, temperature=s.temperature,
                                       top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                       repetition_penalty=s.repetition_penalty, min_tokens_to_keep=keep // K)
            V = log_probs.size(-1)
            scores = (log_probs.view(B, K, V) + running_scores[:, :, None]).view(B, K * V)
            if sampling:
                index = torch.multinomial(scores.softmax(dim=-1), keep, generator=generator)
                top_scores, order = scores.gather(1, index).sort(dim=-1, descending=True)
                index = index.gather(1, order)
            else:
                top_scores, index = torch.topk(scores, keep)                     # (B, keep)
            parent, token = index // V, index % V
        else:
            top_scores, parent, token = _best_continuations(logits, running_scores, keep)
        cand = _gather(running, parent)                                          # (B, keep, T_max)
        cand[:, :, cur] = token
        ends = _ends(cand, token, cur, t0, max_len, eos, stops, s)              # (B, keep)

        # 3a. the best K that do not end keep running
        run_scores = top_scores + ends.to(torch.float32) * NEG
        nxt = torch.topk(run_scores, K).indices
        running, running_scores = _gather(cand, nxt), _gather(run_scores, nxt)
        beam_rows = (_gather(parent, nxt) + batch_offset).view(-1)              # (B*K,) rows to continue

        # 3b. candidates among the top K that end compete for the finished slots
        just_ended = ends & top_k_mask[None, :]
        fin = top_scores / ((cur + 1 - t0) ** s.length_penalty)
        fin = fin + (is_finished.all(dim=-1, keepdim=True) & (s.early_stopping is True)).to(torch.float32) * NEG
        fin = fin + (~improvable).to(torch.float32) * NEG
        fin = fin + (~just_ended) * NEG
        best = torch.topk(torch.cat([finished_scores, fin], dim=1), K).indices
        finished = _gather(torch.cat([finished, cand], dim=1), best)
        finished_scores = _gather(torch.cat([finished_scores, fin], dim=1), best)
        finished_len = _gather(torch.cat([finished_len, torch.full((B, keep), cur + 1, device=device)], dim=1), best)
        is_finished = _gather(torch.cat([is_finished, just_ended], dim=1), best)

        p.stepper.reorder(beam_rows)
        if seen is not None:
            seen = seen.index_select(0, beam_rows)
            seen[torch.arange(B * K, device=device), running[:, :, cur].reshape(-1)] = True

        # 4. can any running beam still beat the worst finished hypothesis?
        length = (max_len if s.early_stopping == "never" and s.length_penalty > 0.0 else cur + 1) - t0
        best_running = running_scores[:, :1] / (length ** s.length_penalty)
        worst = torch.where(is_finished, finished_scores.min(dim=1, keepdim=True)[0], NEG)
        improvable = improvable & (best_running > worst).any(dim=-1, keepdim=True)
        all_full = bool(is_finished.all()) and s.early_stopping is True
        if not bool(improvable.any()) or all_full or bool(ends.all()):
            break

    R = s.num_return_sequences
    out = finished[:, :R].reshape(B * R, max_len)
    return out[:, :int(finished_len[:, :R].max())]


def _best_continuations(logits: Tensor, running_scores: Tensor, keep: int) -> tuple[Tensor, Tensor, Tensor]:
    """Steps 1-2 without adding scores over the whole vocabulary. log p is monotonic in the logit
    within a beam, so each input's best `keep` (beam, token) pairs are among every beam's `keep`
    highest logits: score those K·keep, not K·V. logits (B*K, V), running_scores (B, K) ->
    scores, parent beams and tokens, each (B, keep), best first."""
    B, K = running_scores.shape
    per_beam = min(keep, logits.size(-1))
    top_tokens = top_k_indices(logits, per_beam)                                 # (B*K, per_beam)
    log_p = torch.log_softmax(logits, dim=-1).gather(1, top_tokens)
    scores = (log_p.view(B, K, per_beam) + running_scores[:, :, None]).view(B, K * per_beam)
    top_scores, index = torch.topk(scores, keep)                                 # (B, keep)
    return top_scores, index // per_beam, top_tokens.view(B, K * per_beam).gather(1, index)


CHUNK = 128


def top_k_indices(x: Tensor, k: int) -> Tensor:
    """torch.topk(x, k).indices for x (R, V), k << V, in two cheap passes instead of a partial sort
    of every row (faster at beam search's shapes; BENCHMARKS.md, "Kernels"): the k largest values
    lie in the k chunks of CHUNK columns with the largest maxima (a chunk holding the j-th largest
    value has at most j - 1 chunks with a larger maximum), so only those k·CHUNK columns are sorted."""
    R, V = x.shape
    n = V // CHUNK
    if n < 4 * k:
        return torch.topk(x, k, dim=-1).indices
    head = x[:, :n * CHUNK].view(R, n, CHUNK)
    chunks = torch.topk(head.amax(dim=-1), k, dim=-1).indices                      # (R, k)
    cand = head.gather(1, chunks[:, :, None].expand(R, k, CHUNK)).view(R, k * CHUNK)
    cols = (chunks[:, :, None] * CHUNK + torch.arange(CHUNK, device=x.device)).view(R, k * CHUNK)
    if n * CHUNK < V:                                                              # the ragged end: always a candidate
        cand = torch.cat([cand, x[:, n * CHUNK:]], dim=1)
        cols = torch.cat([cols, torch.arange(n * CHUNK, V, device=x.device).expand(R, -1)], dim=1)
    return cols.gather(1, torch.topk(cand, k, dim=-1).indices)


def _ends(cand: Tensor, token: Tensor, cur: int, t0: int, max_len: int, eos: Tensor | None,
          stops: list[Tensor], s: Settings) -> Tensor:
    """(B, keep) bool: the candidate ends here (EOS, a stop sequence or string, or the length limit)."""
    if cur + 1 >= max_len:
        return torch.ones_like(token, dtype=torch.bool)
    ends = torch.isin(token, eos) if eos is not None else torch.zeros_like(token, dtype=torch.bool)
    if stops or s.stop_strings:
        generated = cand[:, :, t0:cur + 1].reshape(-1, cur + 1 - t0)              # (B*keep, L)
        if stops:
            ends |= sequence_hits(generated, stops).view_as(ends)
        if s.stop_strings:
            hits = string_hits(s.tokenizer, generated.tolist(), s.stop_strings)
            ends |= torch.tensor(hits, device=ends.device).view_as(ends)
    return ends
