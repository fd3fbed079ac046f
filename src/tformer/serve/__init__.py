"""`tformer serve`: an OpenAI-compatible HTTP server with continuous batching (docs/SERVING.md).

    pool.py       the KV cache: one preallocated slot per running sequence
    scheduler.py  one thread owns the model: admits, prefills, decodes all running rows per step
    served.py     the checkpoint, its tokenizers and chat template, the encoders' one-shot work
    chat.py       chat templates, rendered in Jinja's sandbox
    schemas.py    request bodies (OpenAI's fields + tformer's sampling fields)
    app.py        the FastAPI app: routes, the handlers' side of the scheduler
    responses.py  OpenAI's response bodies and stream chunks
    errors.py     OpenAI-shaped errors for every failure
    guard.py      middleware: API key, body limit, starting / draining, requests metric
    metrics.py    Prometheus metrics

Needs the `serve` extra (fastapi, uvicorn, prometheus-client): pip install 'tformer[serve]'.
"""

from .app import Options, create_app
from .served import Served

__all__ = ["create_app", "Options", "Served"]
