"""ASGI middleware in front of every route: API key, body size, starting/draining, request metrics."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from .errors import RETRY_AFTER, error_response


class Guard:
    """ASGI middleware in front of every route: the API key, the body size limit, not serving
    while starting or draining, and the requests-by-status metric."""

    ROUTES = ("/", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/classify", "/v1/models",
              "/health", "/metrics")

    def __init__(self, app, state):  # state: state.State
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
