"""Continuous batching: one thread owns the model and runs it one step at a time.

    waiting (FIFO, <= max_queue)  --admit-->  prefilling (one, in chunks)  --join-->  running (<= max_batch)
                                                                                       |  one token per row
                                                               finished / cancelled <--+  per step

Each iteration of the loop: drop rows whose client went away, prefill joining sequences (at most
`prefill_tokens` prompt tokens while rows are running, so a long prompt never stalls them for more
than one chunk: it is fed in chunks over several iterations; with no row running, whole prompts),
then one decoding step for every running row. A finished row leaves the batch at once and frees its
pool slot for the next waiting sequence; the pool then shrinks if it holds twice what is left.

A prompt is prefilled alone, into a batch-1 cache of its own length, and copied into its pool
slot when complete: its logits are then exactly those of `model.generate` on that prompt alone,
and a row's sampling uses only its own settings and its own torch.Generator, so neither the
other rows nor the order of arrival change what a request gets. With a prefix cache (prefix.py,
decoders), the prompt's longest run of already-prefilled 16-token blocks is copied into that
batch-1 cache first and only the rest is computed; its own blocks are stored as they fill.

Handlers and the loop meet in two places only: `submit` / `cancel` (under a lock), and each
Sequence's `sink`, which the loop calls with every new Event (the server hands it to asyncio).
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from ..model.linear import plan_decoding
from ..model.lora_batched import select_adapters
from .pool import SlotPool
from .prefix import PrefixCache
from .sequence import Event, Sampling, Sequence, Token

__all__ = ["Scheduler", "QueueFull", "Sequence", "Sampling", "Event", "Token"]


class QueueFull(Exception):
    """More sequences waiting than --max-queue allows."""


class Scheduler:
    """Owns `model`: call start(), then submit() sequences from any thread; stop() ends the loop."""

    def __init__(self, model, max_batch: int, max_queue: int, prefill_tokens: int = 256, metrics=None,
                 prefix_bytes: int = 0):
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        self.prefill_tokens, self.metrics = prefill_tokens, metrics
        self.device = next(model.parameters()).device
        self.pool = SlotPool(model, max_batch, model.cfg.max_seq_len)
        # decoders only: an encoder-decoder's decoder prompt is one start token, its keys depend on the source
        self.prefix = PrefixCache(prefix_bytes) if prefix_bytes and not model.is_encoder_decoder else None
        self.keys: list[bytes] = []                # the prefilling sequence's chain of block keys
        plan_decoding(model, max_batch)            # once: plans made for max_batch rows serve fewer rows too
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
                for i in range(len(self.running)):
                    self.pool.free(i)
                self.running, self.prefilling = [], None
                self.pool.trim(0)
            self._gauges()
            self._memory_gauges()

    def _iteration(self) -> None:
        for i in reversed(range(len(self.running))):
            if self.running[i].cancelled:
                self._remove(i)
        if self.prefilling is not None and self.prefilling.cancelled:
            self.prefilling = None
        used = 0
        while len(self.running) < self.max_batch:
            # the budget bounds the running rows' wait; with none running, a whole prompt goes at once
            budget = (self.prefill_tokens if self.running else max(self.prefill_tokens, self.model.cfg.max_seq_len))
            if budget - used <= 0:
                break
            if self.prefilling is None:
                with self.cond:
                    while self.waiting and self.waiting[0].cancelled:
                        self.waiting.popleft()
                    if not self.waiting:
                        break
                    self.prefilling = self.waiting.popleft()
            used += self._prefill(self.prefilling, budget - used)
        if self.running:
            self._decode()
        self.pool.trim(len(self.running))

    def _prefill(self, seq: Sequence, budget: int) -> int:
        """Feed the next chunk of seq's prompt; once it is all in, seq joins the running rows with
        its first token. Returns the number of prompt tokens fed."""
        model = self.model
        select_adapters(model, [seq.adapter])          # the prompt's LoRA adapter (0: none), for encode and step
        if seq.cache is None:
            seq.cache = model.new_cache(1, len(seq.prompt))
            if model.is_encoder_decoder:
                seq.memory = model.encode(torch.tensor([seq.source], device=self.device))   # (1, S, D)
            elif self.prefix is not None:
                self._restore(seq)
        chunk = seq.prompt[seq.fed:seq.fed + budget]
        every = seq.s.prompt_logprobs         # echo + logprobs: every position's logits, (1, T, V)
        logits = model.step(torch.tensor([chunk], device=self.device), seq.cache, memory=seq.memory,
                            all_logits=every)                                 # (1, V), or (1, T, V) if every
        if every:
            seq.note_prompt(logits[0], seq.fed)
            logits = logits[:, -1]
        seq.fed += len(chunk)
        if self.prefix is not None:
            self.prefix.store(self.keys, seq.cache, seq.fed)             # the blocks filled so far
        if seq.fed == len(seq.prompt):
            slot = len(self.running)
            self.pool.admit(slot, seq.cache, seq.memory)
            seq.cache = seq.memory = None
            self.running.append(seq)
            self.prefilling = None
            if seq.push(seq.choose(logits[0]), logits[0], self.metrics):
                self._remove(slot)
        return len(chunk)

    def _restore(self, seq: Sequence) -> None:
        """Copy the prompt's longest cached prefix into its prefill cache: prefilling starts after it."""
        self.keys = self.prefix.keys(seq.prompt, salt=str(seq.adapter))     # another adapter, other keys
        if seq.s.prompt_logprobs:          # echo + logprobs: every prompt position's logits are needed
            return
        seq.fed = self.prefix.restore(seq.prompt, self.keys, seq.cache)
        if self.metrics is not None:
            self.metrics.prefix_queries.inc(len(seq.prompt))
            self.metrics.prefix_hits.inc(seq.fed)

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
        """Row i leaves; the last row takes its slot, so the running rows stay in slots 0..n-1."""
        last = len(self.running) - 1
        if i != last:
            self.pool.move(last, i)
            self.running[i] = self.running[last]
        else:
            self.pool.free(i)
        self.running.pop()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue.set(len(self.waiting))
            self.metrics.batch.set(len(self.running))

    def _memory_gauges(self) -> None:
        """Bytes of keys and values held: the running rows' pool, the prompt being prefilled, the prefix cache."""
        if self.metrics is not None:
            held = self.metrics.kv_bytes
            held.labels("running").set(self.pool.nbytes())
            cache = self.prefilling.cache if self.prefilling is not None else None
            held.labels("prefill").set(sum(2 * c.k.numel() * c.k.element_size() for c in cache.layers) if cache else 0)
            held.labels("prefix").set(self.prefix.nbytes if self.prefix is not None else 0)
