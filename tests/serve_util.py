"""Shared by tests/test_serve*.py: tiny random checkpoints and a real server (uvicorn on a free
loopback port, in a thread of the test process) serving one of them."""

import contextlib
import socket
import threading
import time

import pytest
import torch

import tformer
from tformer import ModelConfig
from tformer.data.tokenizers import Tokenizer

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tformer.serve import Options, Served, create_app  # noqa: E402

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,!?\n"


def char_tokenizer() -> Tokenizer:
    return Tokenizer.char(ALPHABET)


def save_tiny(path, kind: str = "decoder", seed: int = 0, tokenizer: Tokenizer | None = None, **kw):
    """A random model of `kind` with a char tokenizer (or `tokenizer`), saved with tformer.save. No EOS by
    default, so generation runs to max_tokens; an untied output layer so the text is not one letter repeated."""
    tok = tokenizer or char_tokenizer()
    torch.manual_seed(seed)
    base = dict(kind="encoder-decoder" if kind == "encoder-decoder" else "encoder" if kind in ("encoder", "classifier")
                else "decoder", vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                max_seq_len=96, tie_embeddings=False)
    if kind == "encoder-decoder":
        base.update(decoder_start_token_id=tok.bos_id)
    cfg = ModelConfig(**{**base, **kw})
    if kind == "decoder":
        model = tformer.Decoder(cfg)
    elif kind == "encoder-decoder":
        model = tformer.EncoderDecoder(cfg)
    elif kind == "encoder":
        model = tformer.Encoder(cfg)
    else:
        model = tformer.EncoderClassifier(cfg, 3, ["neg", "neutral", "pos"])
    if hasattr(model, "lm_head"):
        with torch.no_grad():                       # spread the logits so greedy choices are clear-cut
            model.lm_head.weight.mul_(5)
    return tformer.save(model.eval(), path, tokenizer=tok)


@contextlib.contextmanager
def serving(path, adapters=(), draft=None, dtype=None, **options):
    """(base_url, app) of a running server for the checkpoint at `path` (+ `adapters`, "NAME=RUN" as
    --adapter takes them, a `draft` model as --draft-model, the weights in `dtype` as --dtype); stopped on exit."""
    served = Served(str(path), adapters=[str(a) for a in adapters], draft=draft and str(draft), dtype=dtype)
    app = create_app(served, Options(**options))
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def client(base: str, key: str = "none") -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
