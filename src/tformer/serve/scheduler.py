"""Continuous batching: one thread owns the model and runs it one step at a time.

    waiting (FIFO, <= max_queue)  --admit-->  prefilling (one, in chunks)  --join-->  running (<= max_batch)
                                                                                       |  one token per row
                                                               finished / cancelled <--+  per step

Each iteration of the loop: drop rows whose client went away, prefill joining sequences (at most
`prefill_tokens` prompt tokens, so a long prompt never stalls the running rows for long: it is fed
in chunks over several iterations), then one decoding step for every running row. A finished
row leaves the batch at once and frees its pool slot for the next waiting sequence.

A prompt is prefilled alone, into a batch-1 cache of its own length, and copied into its pool
slot when complete: its logits are then exactly those of `model.generate` on that prompt alone,
and a row's sampling uses only its own settings and its own torch.Generator, so neither the
other rows nor the order of arrival change what a request gets.

Handlers and the loop meet in two places only: `submit` / `cancel` (under a lock), and each
Sequence's `sink`, which the loop calls with every new Event (the server hands it to asyncio).
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from ..model.linear import plan_decoding
from .pool import SlotPool
from .sequence import Event, Sampling, Sequence, Token

__all__ = ["Scheduler", "QueueFull", "Sequence", "Sampling", "Event", "Token"]


class QueueFull(Exception):
    """More sequences waiting than --max-queue allows."""


class Scheduler:
    """Owns `model`: call start(), then submit() sequences from any thread; stop() ends the loop."""

    def __init__(self, model, max_batch: int, max_queue: int, prefill_tokens: int = 256, metrics=None):
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        self.prefill_tokens, self.metrics = prefill_tokens, metrics
        self.device = next(model.parameters()).device
        self.pool = SlotPool(model, max_batch, model.cfg.max_seq_len)
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
            self._gauges()

    def _iteration(self) -> None:
        for i in reversed(range(len(self.running))):
            if self.running[i].cancelled:
                self._remove(i)
        if self.prefilling is not None and self.prefilling.cancelled:
            self.prefilling = None
        budget = self.prefill_tokens
        while budget > 0 and len(self.running) < self.max_batch:
            if self.prefilling is None:
                with self.cond:
                    while self.waiting and self.waiting[0].cancelled:
                        self.waiting.popleft()
                    if not self.waiting:
                        break
                    self.prefilling = self.waiting.popleft()
            budget -= self._prefill(self.prefilling, budget)
        if self.running:
            self._decode()

    def _prefill(self, seq: Sequence, budget: int) -> int:
        """Feed the next chunk of seq's prompt; once it is all in, seq joins the running rows with
        its first token. Returns the number of prompt tokens fed."""
        model = self.model
        if seq.cache is None:
            seq.cache = model.new_cache(1, len(seq.prompt))
            if model.is_encoder_decoder:
                seq.memory = model.encode(torch.tensor([seq.source], device=self.device))   # (1, S, D)
        chunk = seq.prompt[seq.fed:seq.fed + budget]
        every = seq.s.prompt_logprobs         # echo + logprobs: every position's logits, (1, T, V)
        logits = model.step(torch.tensor([chunk], device=self.device), seq.cache, memory=seq.memory,
                            all_logits=every)                                 # (1, V), or (1, T, V) if every
        if every:
            seq.note_prompt(logits[0], seq.fed)
            logits = logits[:, -1]
        seq.fed += len(chunk)
        if seq.fed == len(seq.prompt):
            slot = len(self.running)
            self.pool.admit(slot, seq.cache, seq.memory)
            seq.cache = seq.memory = None
            self.running.append(seq)
            self.prefilling = None
            if seq.push(seq.choose(logits[0]), logits[0], self.metrics):
                self._remove(slot)
        return len(chunk)

    def _decode(self) -> None:
        """One step for every running row: feed its newest token at its own position."""
        n, pool = len(self.running), self.pool
        ids = torch.tensor([[s.generated[-1]] for s in self.running], device=self.device)     # (n, 1)
        memory = src_mask = None
        if self.model.is_encoder_decoder:
            memory, src_mask = pool.memory_view(n), pool.src_mask(n)
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
