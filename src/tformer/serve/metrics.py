"""Prometheus metrics of one server (their own registry, so several apps can live in one process)."""

from __future__ import annotations

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("tformer_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.tokens_in = Counter("tformer_prompt_tokens", "prompt (and input) tokens read", registry=r)
        self.tokens_out = Counter("tformer_generated_tokens", "tokens generated", registry=r)
        self.cancelled = Counter("tformer_cancelled_requests", "requests whose client went away before the end "
                                 "(their rows left the batch)", registry=r)
        self.queue = Gauge("tformer_queue_length", "sequences waiting for a slot in the running batch", registry=r)
        self.batch = Gauge("tformer_running_batch_size", "sequences in the running batch", registry=r)
        self.prefix_queries = Counter("tformer_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("tformer_prefix_cache_hits", "prompt tokens whose keys and values came from the "
                                   "prefix cache (copied, not computed)", registry=r)
        self.kv_bytes = Gauge("tformer_kv_cache_bytes", "bytes of keys and values held: the running rows' pool, the "
                              "prompt being prefilled, the prefix cache", ["part"], registry=r)
        self.drafted = Counter("tformer_speculative_draft_tokens", "tokens drafted (--prompt-lookup, --draft-model)",
                               registry=r)
        self.accepted = Counter("tformer_speculative_accepted_tokens", "drafted tokens the model's own choice "
                                "matched (each one a forward pass saved)", registry=r)
        self.ttft = Histogram("tformer_time_to_first_token_seconds", "from arrival to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tformer_inter_token_latency_seconds", "between consecutive tokens of one sequence",
                             buckets=LATENCY_BUCKETS, registry=r)

    def kv_held(self, running: int, prefill_cache, prefix: int) -> None:
        """tformer_kv_cache_bytes: the running rows' pool, the prompt being prefilled (its batch-1 cache, or
        None), the prefix cache."""
        prefill = sum(2 * c.k.numel() * c.k.element_size() for c in prefill_cache.layers) if prefill_cache else 0
        for part, held in (("running", running), ("prefill", prefill), ("prefix", prefix)):
            self.kv_bytes.labels(part).set(held)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
