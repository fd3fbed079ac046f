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
import hmac
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..errors import TformerError
from .metrics import Metrics
from .scheduler import Event, QueueFull, Sampling, Scheduler, Sequence
from .schemas import MAX_INPUTS, ChatRequest, ClassifyRequest, CompletionRequest, EmbeddingRequest, Sampled
from .served import InputError, Served

RETRY_AFTER = "1"           # seconds a client should wait after 429 / 503
GENERATES = ("decoder", "encoder-decoder")


@dataclass
class Options:
    max_batch: int = 16                 # rows decoded together; sizes the KV-cache pool (memory is fixed by it)
    max_queue: int = 256                # sequences waiting for a row; beyond it requests get 429
    api_key: str | None = None          # required as "Authorization: Bearer KEY" on /v1/* when set
    max_body_bytes: int = 1 << 20       # larger request bodies get 413
    prefill_tokens: int = 256           # prompt tokens fed per scheduler iteration (bounds a step's latency)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


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
            raise ApiError(400, f"{what} needs a {' or '.join(kinds)} checkpoint; {self.served.name!r} is a "
                                f"{self.served.kind}", param="model", code="model_not_supported")

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


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class CompletionFormat:
    """Bodies of /v1/completions: object "text_completion", choices with text (and logprobs)."""

    def __init__(self, model: str, n: int, echo: list[str], prompt_tokens: int):
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.model, self.n, self.echo, self.prompt_tokens = model, n, echo, prompt_tokens
        self.offsets: dict[int, int] = {}

    def _body(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    def _logprobs(self, index: int, tokens) -> dict | None:
        if not tokens:
            return None
        offsets, at = [], self.offsets.get(index, len(self.echo[index // self.n]))
        for t in tokens:
            offsets.append(at)
            at += len(t.text)
        self.offsets[index] = at
        return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [dict(t.top) for t in tokens], "text_offset": offsets}

    def first_chunks(self) -> list[dict]:
        return [self._body([{"index": i, "text": e, "logprobs": None, "finish_reason": None}])
                for i in range(len(self.echo) * self.n) if (e := self.echo[i // self.n])]

    def chunk(self, event: Event) -> dict:
        return self._body([{"index": event.index, "text": event.text,
                            "logprobs": self._logprobs(event.index, event.tokens),
                            "finish_reason": event.finish_reason}])

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {**self._body([]), "usage": usage(self.prompt_tokens, completion_tokens)}

    def response(self, choices, completion_tokens: int) -> dict:
        return {**self._body([{"index": i, "text": self.echo[i // self.n] + text,
                               "logprobs": self._logprobs(i, tokens) if tokens else None, "finish_reason": reason}
                              for i, text, tokens, reason in choices]),
                "usage": usage(self.prompt_tokens, completion_tokens)}


class ChatFormat:
    """Bodies of /v1/chat/completions: messages and deltas from the assistant."""

    def __init__(self, model: str, prompt_tokens: int):
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.model, self.prompt_tokens = model, prompt_tokens
        self.started: set[int] = set()

    def _body(self, choices: list[dict], obj: str = "chat.completion.chunk") -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    @staticmethod
    def _logprobs(tokens) -> dict | None:
        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        if not tokens:
            return None
        return {"content": [{**entry(t.text, t.logprob), "top_logprobs": [entry(a, lp) for a, lp in t.top]}
                            for t in tokens]}

    def first_chunks(self) -> list[dict]:
        return []

    def chunk(self, event: Event) -> dict:
        delta = {"content": event.text} if event.text else {}
        if event.index not in self.started:
            self.started.add(event.index)
            delta = {"role": "assistant", **delta, "content": event.text}
        return self._body([{"index": event.index, "delta": delta, "logprobs": self._logprobs(event.tokens),
                            "finish_reason": event.finish_reason}])

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {**self._body([]), "usage": usage(self.prompt_tokens, completion_tokens)}

    def response(self, choices, completion_tokens: int) -> dict:
        return {**self._body([{"index": i, "message": {"role": "assistant", "content": text},
                               "logprobs": self._logprobs(tokens), "finish_reason": reason}
                              for i, text, tokens, reason in choices], "chat.completion"),
                "usage": usage(self.prompt_tokens, completion_tokens)}


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(InputError)
    async def input_error(request, e: InputError):
        return error_response(400, str(e), param=e.param, code="invalid_value")

    @app.exception_handler(TformerError)
    async def tformer_error(request, e: TformerError):
        return error_response(400, str(e), code="invalid_value")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid" or not where and first.get("type") == "model_attributes_type":
            return error_response(400, f"the body is not a valid JSON object: {first.get('msg', '')}",
                                  code="invalid_json")
        param = where[0] if where else None      # the field (a union's member names follow it)
        return error_response(422, f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid value')}", param=param,
                              code="invalid_type")

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return error_response(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None,
                              headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        return error_response(500, f"internal error {type(e).__name__}: {e}", "server_error")


class Guard:
    """ASGI middleware in front of every route: the API key, the body size limit, not serving
    while starting or draining, and the requests-by-status metric."""

    ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/classify", "/v1/models",
              "/health", "/metrics")

    def __init__(self, app, state: State):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in self.ROUTES else "other"

        async def counted_send(message):
            if message["type"] == "http.response.start":
                self.state.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        refusal = self._refusal(scope)
        if refusal is None and scope["method"] == "POST":
            body, refusal = await self._read_body(receive)
            if refusal is None:
                receive = replay(body, receive)
        if refusal is not None:
            return await refusal(scope, receive, counted_send)
        await self.app(scope, receive, counted_send)

    def _refusal(self, scope) -> JSONResponse | None:
        state, path = self.state, scope["path"]
        if not path.startswith("/v1/"):
            return None
        key = state.options.api_key
        if key is not None:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + key.encode()):
                return error_response(401, "a valid API key is required (Authorization: Bearer KEY)",
                                      "authentication_error", code="invalid_api_key")
        if not state.ready or (state.draining and scope["method"] == "POST"):
            return error_response(503, "the server is shutting down" if state.draining else "the server is starting",
                                  "server_error", code="unavailable", headers={"Retry-After": RETRY_AFTER})
        return None

    async def _read_body(self, receive) -> tuple[bytes, JSONResponse | None]:
        limit, chunks, size = self.state.options.max_body_bytes, [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", error_response(400, "the client went away")
            size += len(message.get("body", b""))
            if size > limit:
                return b"", error_response(413, f"the request body is over {limit} bytes", code="body_too_large")
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks), None


def replay(body: bytes, receive):
    """A receive() that hands the app the body already read, then listens as usual (for disconnects)."""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
