"""Continuous batching: one thread owns the model and runs it one forward pass at a time.

    waiting (FIFO, <= max_queue)  --start-->  prefilling (in chunks)  --join-->  running (<= max_batch)
                                                                                 |  one token per row
                                                         finished / cancelled <--+  per pass

Each iteration of the loop: drop rows whose client went away, choose the prompt chunks (at most
`prefill_tokens` prompt tokens while rows are running, so a long prompt stalls them for one chunk at
most; with none running, whole prompts, as many as fit), then ONE forward pass for a decoder
(model/ragged.py): every running row's newest token (and its drafts: speculation.py) and the chunks,
each token at its own position, through the same products; only attention keeps the parts apart.
Encoder-decoders (rows read their sources) and T5-style position biases run the chunks alone, then the
decoding step. A finished row leaves at once; the pool shrinks once it holds twice what is left.

A prompt's keys and values go into a batch-1 cache of its own, copied into its pool slot when
complete: those a prefill alone computes (its logits are `model.generate`'s, within the rounding of a
product with more rows); a row samples with its own settings and torch.Generator, so neither the other
rows nor the order of arrival change what a request gets. With a prefix cache (prefix.py, decoders),
the prompt's longest run of stored 16-token blocks is copied into that cache first and only the rest
is computed; its own blocks are stored as they fill.

Handlers and the loop meet in two places only: `submit` / `cancel` (under a lock), and each
Sequence's `sink`, which the loop calls with every new Event (the server hands it to asyncio).
"""

from __future__ import annotations

import threading
from collections import deque

import torch
from torch import Tensor

from ..model.lora_batched import select_adapters
from ..model.plans import plan_decoding
from ..model.ragged import Part, RaggedCache
from .pool import SlotPool
from .prefix import PrefixCache
from .sequence import Event, Sampling, Sequence, Token
from .speculation import drafter, take

__all__ = ["Scheduler", "QueueFull", "Sequence", "Sampling", "Event", "Token"]


class QueueFull(Exception):
    """More sequences waiting than --max-queue allows."""


class Scheduler:
    """Owns `model`: call start(), then submit() sequences from any thread; stop() ends the loop."""

    def __init__(self, model, max_batch: int, max_queue: int, prefill_tokens: int = 256, metrics=None,
                 prefix_bytes: int = 0, prompt_lookup: int = 0, draft_tokens: int = 4, draft_model=None,
                 kv_dtype: torch.dtype | None = None):
        self.model, self.max_batch, self.max_queue, self.prefill_tokens = model, max_batch, max_queue, prefill_tokens
        self.metrics, self.device = metrics, next(model.parameters()).device
        self.pool = SlotPool(model, max_batch, model.cfg.max_seq_len, kv_dtype)       # the running rows' K, V
        # decoders only: an encoder-decoder's decoder prompt is one start token, its keys depend on the source
        self.prefix = PrefixCache(prefix_bytes) if prefix_bytes and not model.is_encoder_decoder else None
        # decoders: the running rows and the prompt chunks in one forward (ragged.py); an encoder-decoder's
        # rows read their sources, T5's position bias depends on the part: their prompts go alone
        self.together = not model.is_encoder_decoder and model.cfg.positional != "relative"
        self.drafts = drafter(draft_model if self.together else None, prompt_lookup if self.together else 0,
                              draft_tokens, max_batch, model.cfg.max_seq_len)   # drafts ride in the ragged pass
        self.waiting: deque[Sequence] = deque()    # guarded by self.cond
        self.running: list[Sequence] = []          # row i is in pool slot i; loop thread only
        self.prefilling: Sequence | None = None
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="tformer-scheduler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, seqs: list[Sequence]) -> None:
        with self.cond:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) + len(seqs) > self.max_queue:
                raise QueueFull(f"{len(self.waiting)} sequences are waiting (--max-queue {self.max_queue})")
            self.waiting.extend(seqs)
            self._gauges()
            self.cond.notify()

    def cancel(self, seqs: list[Sequence]) -> None:
        """The client went away: the rows leave the batch before the next step."""
        with self.cond:
            for s in seqs:
                s.cancelled = True
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread.is_alive():
            self.thread.join()

    # --- the loop (one thread) ------------------------------------------------------------------
    def _loop(self) -> None:
        # once, on this thread (the one that runs the model: one OpenMP pool, cli/serve.py): plans made
        # for max_batch rows serve fewer rows too
        plan_decoding(self.model, self.max_batch)
        self.drafts.prepare()
        while True:
            with self.cond:
                while not (self.waiting or self.running or self.prefilling or self.stopping):
                    self.cond.wait()
                if self.stopping:
                    for s in [*self.waiting, *self.running, *([self.prefilling] if self.prefilling else [])]:
                        s.fail("the server shut down before this request finished")
                    return
            try:
                with torch.inference_mode():
                    self._iteration()
            except Exception as e:  # a bug or out of memory: fail the rows in flight, keep serving the rest
                for s in [*self.running, *([self.prefilling] if self.prefilling else [])]:
                    s.fail(f"internal error {type(e).__name__}: {e}")
                for pool in (self.pool, self.drafts):
                    for i in range(len(self.running)):
                        pool.free(i)
                    pool.trim(0)
                self.running, self.prefilling = [], None
            self._gauges()
            if self.metrics is not None:
                self.metrics.kv_held(self.pool.nbytes() + self.drafts.nbytes(), self.prefilling and
                                     self.prefilling.cache, self.prefix.nbytes if self.prefix else 0)

    def _iteration(self) -> None:
        for i in reversed(range(len(self.running))):
            if self.running[i].cancelled:
                self._remove(i)
        if self.prefilling is not None and self.prefilling.cancelled:
            self.prefilling = None
        # the budget bounds the running rows' wait; with none running, whole prompts go at once
        budget = self.prefill_tokens if self.running else max(self.prefill_tokens, self.model.cfg.max_seq_len)
        chunks = self._joining(budget)
        if self.together and (chunks or self.running):     # (the waiting ones may all have been cancelled)
            self._step(chunks)
        elif not self.together:
            for seq, chunk in chunks:
                self._prefill(seq, chunk)
            if self.running:
                self._decode()
        self.pool.trim(len(self.running))
        self.drafts.trim(len(self.running))

    def _joining(self, budget: int) -> list[tuple[Sequence, list[int]]]:
        """The prompt chunks of this iteration: the prompt being prefilled goes on, then waiting ones
        start, while the budget and the free slots last; at most one is left part-fed (self.prefilling)."""
        chunks = []
        while budget > 0 and len(self.running) + len(chunks) < self.max_batch:
            seq = self.prefilling or self._next_waiting(chunks)
            if seq is None:
                break
            chunk = seq.prompt[seq.fed:seq.fed + budget]
            chunks.append((seq, chunk))
            budget -= len(chunk)
            self.prefilling = seq if seq.fed + len(chunk) < len(seq.prompt) else None
        return chunks

    def _next_waiting(self, chunks: list[tuple[Sequence, list[int]]]) -> Sequence | None:
        """The first waiting sequence, started (its cache, its cached prefix); None if there is none, or
        if its first block is being computed in this iteration for another prompt: it then waits one
        iteration and copies the block from the prefix cache rather than compute it again."""
        with self.cond:
            while self.waiting and self.waiting[0].cancelled:
                self.waiting.popleft()
            if not self.waiting:
                return None
            seq = self.waiting[0]
            if self.prefix is not None:
                seq.keys = seq.keys or self.prefix.keys(seq.prompt, salt=str(seq.adapter))   # another adapter,
                first = seq.keys[:1]                                                     # other keys
                if first and first[0] not in self.prefix and any(s.keys[:1] == first for s, _ in chunks):
                    return None
            self.waiting.popleft()
        select_adapters(self.model, [seq.adapter])        # the prompt's LoRA adapter (0: none), for encode
        seq.cache = self.model.new_cache(1, len(seq.prompt))
        if self.model.is_encoder_decoder:
            seq.memory = self.model.encode(torch.tensor([seq.source], device=self.device))   # (1, S, D)
        elif self.prefix is not None and not seq.s.prompt_logprobs:   # echo + logprobs: every position's logits
            seq.fed = self.prefix.restore(seq.prompt, seq.keys, seq.cache)    # prefilling starts after it
            if self.metrics is not None:
                self.metrics.prefix_queries.inc(len(seq.prompt))
                self.metrics.prefix_hits.inc(seq.fed)
        return seq

    def _step(self, chunks: list[tuple[Sequence, list[int]]]) -> None:
        """One forward pass for a decoder (model/ragged.py): every running row's next token and the prompt
        chunks together, each token at its own position, so the weights are read once for them all."""
        n, pool, running = len(self.running), self.pool, self.running
        drafts = self.drafts.propose(running, pool.lengths, pool.max_len, self.metrics)  # row -> drafted tokens
        if drafts:
            pool.reserve(n, n, max(pool.lengths[i] + 1 + len(d) for i, d in drafts.items()))
        parts, ids, positions, adapters = [], [], [], []

        def feed(part: Part, tokens: list[int], at, adapter: list[int]) -> range:
            """The part's tokens into the pass, at positions `at`, each with its adapter -> their indices."""
            parts.append(part)
            ids.extend(tokens)
            positions.extend(at)
            adapters.extend(adapter)
            return range(len(ids) - len(tokens), len(ids))

        heads = list(feed(Part(pool.view(n), n, 1, pool.mask(n)), [s.generated[-1] for s in running],
                          pool.lengths[:n], [s.adapter for s in running]) if n else [])   # whose logits we need
        checks = {}                                              # row -> where its drafts' logits are in heads
        for i, d in drafts.items():                              # after the row's newest token, in its slot
            start, checks[i] = pool.lengths[i] + 1, list(range(len(heads), len(heads) + len(d)))
            heads += feed(Part(pool.run(i, start), 1, len(d)), d, range(start, start + len(d)),
                          [running[i].adapter] * len(d))
        spans = []
        for seq, chunk in chunks:
            fed = feed(Part(seq.cache, 1, len(chunk)), chunk, range(seq.fed, seq.fed + len(chunk)),
                       [seq.adapter] * len(chunk))
            every, last = seq.s.prompt_logprobs, seq.fed + len(chunk) == len(seq.prompt)
            wanted = fed if every else fed[-1:] if last else range(0)
            spans.append(slice(len(heads), len(heads) + len(wanted)))
            heads += wanted
        select_adapters(self.model, adapters)                    # each token's LoRA adapter
        tensor = torch.tensor
        hidden = self.model.step(tensor(ids, device=self.device)[:, None], RaggedCache(parts, self.device),
                                 positions=tensor(positions, device=self.device)[:, None], head=False)   # (N, D)
        if not heads:                                  # a prompt's middle chunk alone: nothing to choose yet
            seq, chunk = chunks[0]
            self._fed(seq, len(chunk), None)
            return
        select_adapters(self.model, [adapters[i] for i in heads])         # an adapter may reach the output layer
        logits = self.model.lm_head(hidden[tensor(heads, device=self.device)])                          # (M, V)
        pool.advance(n, [take(seq, logits[[i, *checks.get(i, ())]], drafts.get(i, []), self.metrics)
                         for i, seq in enumerate(running)])
        for i in reversed(range(n)):
            if running[i].done:
                self._remove(i)
        for (seq, chunk), span in zip(chunks, spans):
            self._fed(seq, len(chunk), logits[span])

    def _prefill(self, seq: Sequence, chunk: list[int]) -> None:
        """Feed a chunk of seq's prompt alone (an encoder-decoder's, or a decoder with a position bias)."""
        select_adapters(self.model, [seq.adapter])
        every = seq.s.prompt_logprobs         # echo + logprobs: every position's logits, (1, T, V)
        logits = self.model.step(torch.tensor([chunk], device=self.device), seq.cache, memory=seq.memory,
                                 all_logits=every)                             # (1, V), or (1, T, V) if every
        self._fed(seq, len(chunk), logits[0] if every else logits)

    def _fed(self, seq: Sequence, t: int, logits: Tensor) -> None:
        """seq's next t prompt tokens are in its cache, `logits` (T, V) of each with echo + logprobs, else
        of the last (1, V) (or none, mid-prompt): note them, store the filled blocks in the prefix cache,
        and once the prompt is all in, copy it to a pool slot and take its first token."""
        if seq.s.prompt_logprobs:
            seq.note_prompt(logits, seq.fed)
        seq.fed += t
        if self.prefix is not None:
            self.prefix.store(seq.keys, seq.cache, seq.fed)              # the blocks filled so far
        if seq.fed == len(seq.prompt):
            slot = len(self.running)
            self.pool.admit(slot, seq.cache, seq.memory)
            seq.cache = seq.memory = None
            self.running.append(seq)
            if seq.push(seq.choose(logits[-1]), logits[-1], self.metrics):
                self._remove(slot)

    def _decode(self) -> None:
        """One step for every running row: feed its newest token at its own position."""
        n, pool = len(self.running), self.pool
        ids = torch.tensor([[s.generated[-1]] for s in self.running], device=self.device)     # (n, 1)
        memory = src_mask = None
        if self.model.is_encoder_decoder:
            memory, src_mask = pool.memory_view(n), pool.src_mask(n)
        select_adapters(self.model, [s.adapter for s in self.running])       # each row's LoRA adapter
        logits = self.model.step(ids, pool.view(n), pool.mask(n), pool.positions(n), memory, src_mask)  # (n, V)
        pool.advance(n)
        finished = [i for i, s in enumerate(self.running) if s.push(s.choose(logits[i]), logits[i], self.metrics)]
        for i in reversed(finished):
            self._remove(i)

    def _remove(self, i: int) -> None:
        """Row i leaves; the last row takes its slot, so the running rows stay in slots 0..n-1. With a
        prefix cache, its prompt and generated tokens' full blocks are stored first: the next turn of a
        conversation (this reply in its prompt) finds them, as in vLLM and llama.cpp's cache_prompt."""
        if self.prefix is not None:
            seq, held = self.running[i], self.pool.lengths[i]        # positions filled: all but the last token
            tokens = (seq.prompt + seq.generated)[:held]
            self.prefix.store(self.prefix.keys(tokens, salt=str(seq.adapter)), self.pool.slot(i), held)
        last = len(self.running) - 1
        if i != last:
            self.pool.move(last, i)
            self.drafts.move(last, i)
            self.running[i] = self.running[last]
        else:
            self.pool.free(i)
            self.drafts.free(i)
        self.running.pop()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue.set(len(self.waiting))
            self.metrics.batch.set(len(self.running))
