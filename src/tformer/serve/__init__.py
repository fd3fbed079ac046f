"""`tformer serve`: an OpenAI-compatible HTTP server with continuous batching (docs/SERVING.md).

    pool.py       the KV cache: one slot per running sequence, grown and shrunk with what the rows hold
    prefix.py     the prefix cache: prefilled prompt blocks found by their hash chain, copied into new prompts
    scheduler.py  one thread owns the model: admits, prefills, decodes all running rows per step
    sequence.py   one row: its sampling settings and logits processing, its text and logprobs, its events
    served.py     the checkpoint, its tokenizers and chat template, the encoders' one-shot work
    schemas.py    request bodies (OpenAI's fields + tformer's sampling fields)
    state.py      the server's options and what the handlers share
    jobs.py       the handlers' side of the scheduler: submit, answer whole or stream, cancel when the client goes
    app.py        the FastAPI app: the routes
    responses.py  OpenAI's response bodies and stream chunks
    errors.py     OpenAI-shaped errors for every failure
    guard.py      middleware: API key, body limit, starting / draining, requests metric
    metrics.py    Prometheus metrics
    chat.html     the chat page at GET / (one static file, vanilla JS)

Needs the `serve` extra (fastapi, uvicorn, prometheus-client): pip install 'tformer[serve]'.
"""

from .app import Options, create_app
from .served import Served

__all__ = ["create_app", "Options", "Served"]
