"""What the handlers share: the server's options, and the State (the served model, its scheduler or
encoder worker, the metrics, starting / draining)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .errors import RETRY_AFTER, ApiError
from .grammar import Grammars
from .metrics import Metrics
from .scheduler import Scheduler
from .served import Served

GENERATES = ("decoder", "encoder-decoder")


@dataclass
class Options:
    max_batch: int = 16                 # rows decoded together; sizes the KV-cache pool (memory is fixed by it)
    max_queue: int = 256                # sequences waiting for a row; beyond it requests get 429
    api_key: str | None = None          # required as "Authorization: Bearer KEY" on /v1/* when set
    max_body_bytes: int = 1 << 20       # larger request bodies get 413
    prefill_tokens: int = 128           # prompt tokens fed per iteration with the decoding rows: inter-token p99
                                        # within 3x p50 at about the throughput of 256 (docs/SERVING.md, "Measured")
    prefix_cache_mb: float = 256        # bytes (MiB) of prefilled prompt blocks kept for reuse; 0: no prefix cache
    prompt_lookup: int = 0              # speculative decoding: drafts from the row's own text after its last
                                        # n-gram (n = this; 0: off), decoders only; the same text either way
    draft_tokens: int = 4               # tokens drafted per row and step with prompt_lookup or a draft model
                                        # (Served's draft, `tformer serve --draft-model RUN`)
    kv_cache_dtype: str = "auto"        # the running rows' keys and values: "auto" (the model's dtype) or "bf16"
                                        # (half the memory and the bytes read a step; pool.py)


KV_DTYPES = {"auto": None, "bf16": torch.bfloat16}      # Options.kv_cache_dtype -> SlotPool's kv_dtype


class State:
    """What the handlers share: the model, its scheduler (generating models) or worker (encoders)."""

    def __init__(self, served: Served, options: Options):
        self.served, self.options, self.metrics = served, options, Metrics()
        # structured outputs: grammars over the output tokenizer's vocabulary, stopped by the model's EOS
        self.grammars = Grammars(served.tokenizer, served.model.cfg.vocab_size, served.eos)
        self.scheduler: Scheduler | None = None
        self.worker: ThreadPoolExecutor | None = None   # encoders: one thread owns the model
        self.pending = 0                                 # encoder requests queued or running
        self.ready = self.draining = False

    def start(self) -> None:
        if self.served.kind in GENERATES:
            self.scheduler = Scheduler(self.served.model, self.options.max_batch, self.options.max_queue,
                                       self.options.prefill_tokens, self.metrics,
                                       prefix_bytes=int(self.options.prefix_cache_mb * 2**20),
                                       prompt_lookup=self.options.prompt_lookup,
                                       draft_tokens=self.options.draft_tokens, draft_model=self.served.draft,
                                       kv_dtype=KV_DTYPES[self.options.kv_cache_dtype])
            self.scheduler.start()
        else:
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="tformer-encoder")
        self.ready = True

    def stop(self) -> None:
        self.ready = False
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.worker is not None:
            self.worker.shutdown(wait=True)

    def require(self, model: str | None, kinds: tuple[str, ...], what: str) -> int:
        """The adapter `model` names (0: the base, also when omitted), served at `what`; else 404 / 400."""
        adapter = self.served.adapters.number(model)
        if adapter is None:
            names = ", ".join(map(repr, self.served.adapters.names))
            raise ApiError(404, f"The model {model!r} does not exist (this server serves {names})",
                           param="model", code="model_not_found")
        if self.served.kind not in kinds:
            raise ApiError(400, f"{what} serves {' and '.join(kinds)} checkpoints; {self.served.name!r} is of kind "
                                f"{self.served.kind!r}", param="model", code="model_not_supported")
        return adapter

    async def on_encoder(self, fn, *args):
        """Run fn on the encoder thread, at most max_queue requests queued."""
        if self.pending >= self.options.max_queue:
            raise ApiError(429, f"{self.pending} requests are waiting (--max-queue {self.options.max_queue})",
                           "rate_limit_error", code="queue_full", headers={"Retry-After": RETRY_AFTER})
        self.pending += 1
        self.metrics.queue.set(self.pending)
        try:
            return await asyncio.wrap_future(self.worker.submit(fn, *args))
        finally:
            self.pending -= 1
            self.metrics.queue.set(self.pending)
