"""The HTTP API: OpenAI's request and response bodies over FastAPI, streaming as Server-Sent Events.

    POST /v1/completions        decoder / encoder-decoder        GET /v1/models
    POST /v1/chat/completions   models with a chat template      GET /health   (503 unless serving)
    POST /v1/embeddings         encoders                         GET /metrics  (Prometheus text)
    POST /v1/classify           classifiers

Every error is OpenAI's shape, {"error": {"message", "type", "param", "code"}}. Requests are
stateless: any replica can answer any request.
"""

from __future__ import annotations

import asyncio
import base64
import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .errors import RETRY_AFTER, ApiError, add_error_handlers
from .guard import Guard
from .metrics import Metrics
from .responses import ChatFormat, CompletionFormat
from .scheduler import Event, QueueFull, Sampling, Scheduler, Sequence
from .schemas import MAX_INPUTS, ChatRequest, ClassifyRequest, CompletionRequest, EmbeddingRequest, Sampled
from .served import Served

GENERATES = ("decoder", "encoder-decoder")


@dataclass
class Options:
    max_batch: int = 16                 # rows decoded together; sizes the KV-cache pool (memory is fixed by it)
    max_queue: int = 256                # sequences waiting for a row; beyond it requests get 429
    api_key: str | None = None          # required as "Authorization: Bearer KEY" on /v1/* when set
    max_body_bytes: int = 1 << 20       # larger request bodies get 413
    prefill_tokens: int = 256           # prompt tokens fed per scheduler iteration (bounds a step's latency)


class State:
    """What the handlers share: the model, its scheduler (generating models) or worker (encoders)."""

    def __init__(self, served: Served, options: Options):
        self.served, self.options, self.metrics = served, options, Metrics()
        self.scheduler: Scheduler | None = None
        self.worker: ThreadPoolExecutor | None = None   # encoders: one thread owns the model
        self.pending = 0                                 # encoder requests queued or running
        self.ready = self.draining = False

    def start(self) -> None:
        if self.served.kind in GENERATES:
            self.scheduler = Scheduler(self.served.model, self.options.max_batch, self.options.max_queue,
                                       self.options.prefill_tokens, self.metrics)
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

    def require(self, model: str, kinds: tuple[str, ...], what: str):
        if model != self.served.name:
            raise ApiError(404, f"The model {model!r} does not exist (this server serves {self.served.name!r})",
                           param="model", code="model_not_found")
        if self.served.kind not in kinds:
            raise ApiError(400, f"{what} serves {' and '.join(kinds)} checkpoints; {self.served.name!r} is of kind "
                                f"{self.served.kind!r}", param="model", code="model_not_supported")

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


class Job:
    """The sequences of one request and the asyncio queue the scheduler thread feeds."""

    def __init__(self, state: State, seqs_args: list[tuple[int, list[int], Sampling, list[int] | None]]):
        self.state, self.queue = state, asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(event: Event) -> None:        # called on the scheduler's thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:                 # the event loop has closed: nobody is listening
                pass

        served = state.served
        self.seqs = [Sequence(i, prompt, s, served.output, served.eos, sink, source, served.device)
                     for i, prompt, s, source in seqs_args]

    def submit(self) -> None:
        try:
            self.state.scheduler.submit(self.seqs)
        except QueueFull as e:
            if self.state.draining or self.state.scheduler.stopping:
                raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down",
                               headers={"Retry-After": RETRY_AFTER}) from None
            raise ApiError(429, f"the server is busy: {e}", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": RETRY_AFTER}) from None

    async def events(self):
        """Events until every sequence is finished; leaving early (a client gone) cancels the rest."""
        left = len(self.seqs)
        try:
            while left:
                event: Event = await self.queue.get()
                if event.finish_reason is not None or event.error is not None:
                    left -= 1
                yield event
        finally:
            if left:
                self.state.scheduler.cancel(self.seqs)


def create_app(served: Served, options: Options | None = None) -> FastAPI:
    state = State(served, options or Options())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        yield
        state.stop()

    app = FastAPI(title="tformer", version="1", lifespan=lifespan)
    app.state.tformer = state
    app.add_middleware(Guard, state=state)
    add_error_handlers(app)

    @app.get("/health")
    def health():
        if not state.ready or state.draining:
            return JSONResponse({"status": "draining" if state.draining else "starting"}, status_code=503)
        return {"status": "ok", "model": served.name}

    @app.get("/metrics")
    def metrics():
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                             "owned_by": "tformer", "kind": served.kind}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        state.require(body.model, GENERATES, "/v1/completions")
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        check_count(prompts, "prompt")
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs (the prompt's log-probabilities) is not supported", param="echo")
        ids = [served.prompt_ids(p) for p in prompts]
        for p in ids:
            served.check_budget(len(p), body.max_tokens)
        job = start_job(state, body, ids, body.max_tokens, body.logprobs)
        echo = prompts if body.echo else [""] * len(prompts)
        fmt = CompletionFormat(served.name, body.n, echo, sum(map(len, ids)))
        return await respond(job, fmt, body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        state.require(body.model, GENERATES, "/v1/chat/completions")
        ids = served.chat_ids([{"role": m.role, "content": m.text()} for m in body.messages])
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, served.context - len(ids))
        served.check_budget(len(ids), max_tokens)
        top = (body.top_logprobs or 0) if body.logprobs else None
        job = start_job(state, body, [ids], max_tokens, top)
        return await respond(job, ChatFormat(served.name, len(ids)), body)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        state.require(body.model, ("encoder",), "/v1/embeddings")
        texts = [body.input] if isinstance(body.input, str) else body.input
        check_count(texts, "input")
        vectors, tokens = await state.on_encoder(served.embed, texts)
        state.metrics.tokens_in.inc(tokens)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
                 if body.encoding_format == "base64" else v.tolist()} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": served.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest):
        state.require(body.model, ("classifier",), "/v1/classify")
        texts = [body.input] if isinstance(body.input, str) else body.input
        check_count(texts, "input")
        probs, tokens = await state.on_encoder(served.classify, texts)
        state.metrics.tokens_in.inc(tokens)
        data = [{"index": i, "label": served.labels[int(p.argmax())],
                 "probabilities": {label: float(q) for label, q in zip(served.labels, p)}} for i, p in enumerate(probs)]
        return {"object": "list", "data": data, "model": served.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return app


def check_count(items: list, param: str) -> None:
    if not 1 <= len(items) <= MAX_INPUTS:
        raise ApiError(400, f"{param} must hold 1 to {MAX_INPUTS} items, got {len(items)}", param=param)


def start_job(state: State, body: Sampled, prompts: list[list[int]], max_tokens: int, logprobs: int | None) -> Job:
    """One sequence per prompt and choice (choice k of a seeded request uses seed + k)."""
    served, args = state.served, []
    for p, prompt in enumerate(prompts):
        for k in range(body.n):
            s = Sampling(max_tokens, body.temperature, body.top_p, body.top_k or None, body.min_p,
                         body.repetition_penalty, None if body.seed is None else (body.seed + k) % 2**63,
                         body.stops(), logprobs)
            source = prompt if served.model.is_encoder_decoder else None
            args.append((p * body.n + k, [served.start] if source else prompt, s, source))
    if served.model.is_encoder_decoder and served.start is None:
        raise ApiError(400, "the model config has no decoder start token (decoder_start_token_id, bos or pad)")
    state.metrics.tokens_in.inc(sum(map(len, prompts)))
    job = Job(state, args)
    job.submit()
    return job


async def respond(job: Job, fmt, body: Sampled):
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(sse(job, fmt, usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    texts, tokens, reasons = {}, {}, {}
    async for event in job.events():
        if event.error is not None:
            raise ApiError(500, event.error, "server_error")
        texts[event.index] = texts.get(event.index, "") + event.text
        tokens.setdefault(event.index, []).extend(event.tokens)
        if event.finish_reason is not None:
            reasons[event.index] = event.finish_reason
    return fmt.response([(i, texts.get(i, ""), tokens.get(i, []), reasons.get(i)) for i in range(len(job.seqs))],
                        sum(len(s.generated) for s in job.seqs))


async def sse(job: Job, fmt, include_usage: bool):
    """data: {chunk} lines, then data: [DONE]. A client that disconnects cancels this generator,
    and Job.events() then cancels its sequences."""
    for chunk in fmt.first_chunks():
        yield f"data: {json.dumps(chunk)}\n\n"
    async for event in job.events():
        if event.error is not None:
            yield f"data: {json.dumps({'error': {'message': event.error, 'type': 'server_error'}})}\n\n"
            break
        if event.text or event.tokens or event.finish_reason:
            yield f"data: {json.dumps(fmt.chunk(event))}\n\n"
    if include_usage:
        yield f"data: {json.dumps(fmt.usage_chunk(sum(len(s.generated) for s in job.seqs)))}\n\n"
    yield "data: [DONE]\n\n"


