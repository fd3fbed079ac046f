"""A client that goes away cancels its request, streamed or not: its row leaves the batch long before
its max_tokens, /metrics counts it (tformer_cancelled_requests_total, requests with status 499), and
the server goes on serving. A real uvicorn server on 127.0.0.1; the client is httpx with a short
read timeout (it closes the connection when the timeout fires)."""

import re
import threading

import pytest

from serve_util import client, httpx, save_tiny, serving, wait_for

MAX_TOKENS = 3000           # far more than a second's worth of steps: the request cannot finish first


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("cancel") / "dec", "decoder", max_seq_len=MAX_TOKENS + 64)


def metric(base: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{base}/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def first_running(scheduler, found: list) -> threading.Thread:
    """A watcher that keeps the first sequence to join the running rows (the scheduler thread drops
    it from `running` when it is cancelled, so it must be caught while it runs)."""
    def watch():
        if wait_for(lambda: bool(scheduler.running), timeout=30):
            found.append(scheduler.running[0])

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_non_streamed_request_whose_client_leaves_is_cancelled(decoder):
    with serving(decoder, max_batch=2) as (base, app):
        scheduler, found = app.state.tformer.scheduler, []
        watcher = first_running(scheduler, found)
        body = {"model": "dec", "prompt": "a long story", "max_tokens": MAX_TOKENS, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
        watcher.join(timeout=30)
        seq = found[0]
        assert wait_for(lambda: not scheduler.running and seq.cancelled, timeout=10)
        assert 0 < len(seq.generated) < MAX_TOKENS
        assert metric(base, "tformer_cancelled_requests_total") == 1
        assert metric(base, "tformer_running_batch_size") == 0
        assert 'endpoint="/v1/completions",status="499"' in httpx.get(f"{base}/metrics").text
        generated = metric(base, "tformer_generated_tokens_total")
        assert generated == len(seq.generated) < MAX_TOKENS          # no step ran after it left

        again = client(base).completions.create(model="dec", prompt="a", max_tokens=5)
        assert again.choices[0].finish_reason == "length"
        assert metric(base, "tformer_cancelled_requests_total") == 1  # a request that ends is not counted


def test_a_stream_whose_client_leaves_is_counted_too(decoder):
    with serving(decoder, max_batch=2) as (base, app):
        scheduler = app.state.tformer.scheduler
        body = {"model": "dec", "prompt": "a story", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines), next(lines)                                   # two chunks, then hang up
            seq = scheduler.running[0]
        assert wait_for(lambda: not scheduler.running and seq.cancelled, timeout=10)
        assert len(seq.generated) < MAX_TOKENS
        assert wait_for(lambda: metric(base, "tformer_cancelled_requests_total") == 1, timeout=10)
