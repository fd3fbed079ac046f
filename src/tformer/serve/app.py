"""The HTTP API: OpenAI's request and response bodies over FastAPI, streaming as Server-Sent Events.

    POST /v1/completions        decoder / encoder-decoder        GET /v1/models
    POST /v1/chat/completions   models with a chat template      GET /health   (503 unless serving)
    POST /v1/embeddings         encoders                         GET /metrics  (Prometheus text)
    POST /v1/classify           classifiers                      GET /         the chat page (chat.html)

Every error is OpenAI's shape, {"error": {"message", "type", "param", "code"}}. Requests are
stateless: any replica can answer any request.
"""

from __future__ import annotations

import base64
from contextlib import asynccontextmanager
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from .errors import ApiError, add_error_handlers
from .guard import Guard
from .jobs import respond, start_job
from .responses import ChatFormat, CompletionFormat
from .schemas import MAX_INPUTS, ChatRequest, ClassifyRequest, CompletionRequest, EmbeddingRequest
from .served import Served
from .state import GENERATES, Options, State
from .structured import Tools, compile_grammar, wanted_schema

__all__ = ["create_app", "Options"]

PAGE = "chat.html"          # the chat page at GET /: one static file, shipped as package data
# the page's own script and style are inline; it reaches nothing but this server
PAGE_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


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

    page = files(__package__).joinpath(PAGE).read_text(encoding="utf-8")

    @app.get("/", include_in_schema=False)
    def chat_page():
        return HTMLResponse(page, headers={"Content-Security-Policy": PAGE_POLICY, "Cache-Control": "no-cache"})

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
    def models():       # the base, then each adapter with its base as "parent" (as vLLM lists LoRA adapters)
        names = served.adapters.names
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "tformer",
                                            "kind": served.kind, "parent": None if k == 0 else served.name}
                                           for k, name in enumerate(names)]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        adapter = state.require(body.model, GENERATES, "/v1/completions")
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        check_count(prompts, "prompt")
        echo_logprobs = body.echo and body.logprobs is not None      # the prompt's tokens' logprobs too
        if echo_logprobs and served.model.is_encoder_decoder:
            raise ApiError(400, "echo with logprobs needs a decoder: an encoder-decoder's prompt is its source text, "
                                "which nothing predicts", param="echo")
        ids = [served.prompt_ids(p) for p in prompts]
        for p in ids:
            served.check_budget(len(p), body.max_tokens)
        constrained, schema = wanted_schema(body.response_format)
        grammar = await compile_grammar(state.grammars, schema) if constrained else None
        job = start_job(state, body, ids, body.max_tokens, body.logprobs, echo_logprobs, grammar, adapter)
        echo = prompts if body.echo else [""] * len(prompts)
        fmt = CompletionFormat(served.adapters.names[adapter], body.n, echo, sum(map(len, ids)), echo_logprobs,
                               body.return_tokens_as_token_ids)
        return await respond(job, fmt, body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        adapter = state.require(body.model, GENERATES, "/v1/chat/completions")
        tools = Tools(body, served.chat.source if served.chat is not None else None)
        ids = served.chat_ids([m.for_template() for m in body.messages], tools.for_template)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, served.context - len(ids))
        served.check_budget(len(ids), max_tokens)
        constrained, schema = (True, tools.schema()) if tools.forced else wanted_schema(body.response_format)
        grammar = (await compile_grammar(state.grammars, schema, "tools" if tools.forced else "response_format")
                   if constrained else None)
        calls = tools if tools.forced or not constrained else None     # a requested JSON answer is not a call
        top = (body.top_logprobs or 0) if body.logprobs else None
        job = start_job(state, body, [ids], max_tokens, top, grammar=grammar, adapter=adapter)
        fmt = ChatFormat(served.adapters.names[adapter], len(ids), calls, body.return_tokens_as_token_ids)
        return await respond(job, fmt, body, request)

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
