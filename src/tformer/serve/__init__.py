"""`tformer serve`: an OpenAI-compatible HTTP server with continuous batching (docs/SERVING.md).

    pool.py       the KV cache: one preallocated slot per running sequence
    scheduler.py  one thread owns the model: admits, prefills, decodes all running rows per step
    served.py     the checkpoint, its tokenizers and chat template, the encoders' one-shot work
    chat.py       chat templates, rendered in Jinja's sandbox
    schemas.py    request bodies (OpenAI's fields + tformer's sampling fields)
    app.py        the FastAPI app: routes, errors, API key, body limit, metrics
    metrics.py    Prometheus metrics

Needs the `serve` extra (fastapi, uvicorn, prometheus-client): pip install 'tformer[serve]'.
"""

from .app import Options, create_app
from .served import Served

__all__ = ["create_app", "Options", "Served"]
