"""`tformer serve`: an OpenAI-compatible HTTP server for a checkpoint, with continuous batching.

    tformer serve --model runs/shakespeare                       # http://127.0.0.1:8000/v1
    tformer serve --model runs/base --adapter poet=runs/poet-lora --adapter legal=runs/legal-lora
    TFORMER_API_KEY=secret tformer serve --model runs/gpt2 --host 0.0.0.0 --port 8080

Endpoints: /v1/completions, /v1/chat/completions (models with a chat template), /v1/embeddings
(encoders), /v1/classify (classifiers), /v1/models, /health, /metrics. SIGTERM stops taking
requests, finishes the running ones (up to --grace seconds) and exits 0. See docs/SERVING.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

from tformer.cli import COMMANDS
from tformer.cli.args import nonneg_float, number, positive_int
from tformer.cli.common import add_dtype_flag, apply_only_to, model_dtype

port = number(int, 0, 65535, what="a port number")


def register(sub) -> None:
    p = sub.add_parser("serve", help=COMMANDS["serve"], description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="RUN", help="checkpoint or run directory to serve")
    p.add_argument("--name", default=None, help="the model's name in the API (default: the directory's name)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=RUN",
                   help="serve a LoRA adapter of --model (a `tformer train --lora-r` run or checkpoint, or a peft "
                        "adapter directory) as model NAME; repeat for more. Requests choose by their model field")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s: this machine only)")
    p.add_argument("--port", type=port, default=8000, help="port (default %(default)s; 0 picks a free one)")
    p.add_argument("--max-batch", type=positive_int, default=16,
                   help="sequences decoded together; sizes the KV-cache pool (default %(default)s)")
    p.add_argument("--max-queue", type=positive_int, default=256,
                   help="sequences waiting for a place in the batch; more get HTTP 429 (default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("TFORMER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TFORMER_API_KEY, else none)")
    p.add_argument("--grace", type=nonneg_float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long running requests may take to finish (default %(default)s)")
    p.add_argument("--max-body", type=positive_int, default=1 << 20, metavar="BYTES",
                   help="largest request body; larger ones get HTTP 413 (default %(default)s)")
    p.add_argument("--device", default=None, help="torch device for the model (default: where it loads, the CPU)")
    add_dtype_flag(p)
    p.add_argument("--prefill-tokens", type=positive_int, default=None, metavar="N",
                   help="prompt tokens prefilled per step while other rows decode, which bounds their wait "
                        "(default: serve.Options', see docs/SERVING.md)")
    p.add_argument("--prefix-cache-mb", type=nonneg_float, default=None, metavar="MIB",
                   help="keys and values of prompt prefixes kept for reuse by later prompts (decoders); "
                        "0 turns the prefix cache off (default: serve.Options', see docs/SERVING.md)")
    p.add_argument("--prompt-lookup", type=positive_int, default=None, metavar="N",
                   help="speculative decoding without a draft model (decoders): each row drafts the tokens that "
                        "followed its last N tokens earlier in its text and the step checks them; the same text "
                        "as without (default: off)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "bf16"), default=None,
                   help="the running rows' keys and values: the model's dtype (auto), or bf16: half the memory "
                        "and the bytes read per step, rounded to 8 significant bits (default: auto)")
    p.add_argument("--draft-model", default=None, metavar="RUN",
                   help="speculative decoding with a small decoder trained with the model's tokenizer: it drafts "
                        "for every row, the step checks; the same text as without (default: off)")
    p.add_argument("--num-draft-tokens", type=positive_int, default=None, metavar="K",
                   help="tokens drafted per row and step with --prompt-lookup or --draft-model (default 4)")
    p.set_defaults(func=run)


def on_a_thread_of_its_own(fn, *args):
    """fn(*args) on a thread that ends with it, so that the main thread never runs an OpenMP region.
    libgomp keeps a pool of worker threads for each thread that ran one; with the main thread's pool
    (loading a model makes one) beside the scheduler's it manages more threads than there are cores,
    cuts its workers' spinning short, and each parallel region of the scheduler then waits for a
    worker to wake: 10-25% of the throughput on 2 cores (docs/SERVING.md). A thread's pool ends with it."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def run(args) -> int:
    from tformer.errors import ConfigError

    try:
        import uvicorn

        from tformer.serve import Options, Served, create_app
    except ImportError as e:
        raise ConfigError(f"tformer serve needs the serve extra ({e.name} is missing): pip install 'tformer[serve]'") \
            from None
    if args.num_draft_tokens is not None and args.prompt_lookup is None and args.draft_model is None:
        raise ConfigError("--num-draft-tokens needs --prompt-lookup N or --draft-model RUN")
    if args.prompt_lookup is not None and args.draft_model is not None:
        raise ConfigError("give --draft-model or --prompt-lookup, not both (one source of drafts)")
    served = on_a_thread_of_its_own(Served, args.model, args.name, args.device, args.adapter, args.draft_model,
                                    model_dtype(args.dtype, args.device))
    drafts = "--prompt-lookup" if args.prompt_lookup is not None else "--draft-model" if args.draft_model else None
    if drafts and (served.kind != "decoder" or served.model.cfg.positional == "relative"):
        raise ConfigError(f"{drafts} serves decoders without a position bias; {served.name!r} is "
                          f"{'an encoder-decoder' if served.kind == 'encoder-decoder' else 'not one'}")
    from tformer.serve.state import GENERATES

    generates, decoder = served.kind in GENERATES, served.kind == "decoder"
    unused = [flag for flag, value, applies in (("--prefill-tokens", args.prefill_tokens, generates),
                                                ("--kv-cache-dtype", args.kv_cache_dtype, generates),
                                                ("--prefix-cache-mb", args.prefix_cache_mb, decoder))
              if value is not None and not applies]
    if unused:
        kind = f"{'an' if served.kind[0] in 'aeiou' else 'a'} {served.kind}"
        raise ConfigError(apply_only_to(unused, "decoders" if generates else "models that generate text",
                                        f"; {served.name!r} is {kind}: drop {{it}}"))
    given = {k: v for k, v in (("prefill_tokens", args.prefill_tokens), ("prefix_cache_mb", args.prefix_cache_mb),
                               ("prompt_lookup", args.prompt_lookup), ("draft_tokens", args.num_draft_tokens),
                               ("kv_cache_dtype", args.kv_cache_dtype))
             if v is not None}                                    # else Options' defaults, stated there once
    app = create_app(served, Options(args.max_batch, args.max_queue, args.api_key or None, args.max_body, **given))
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e} "
                          "(choose another --port or --host)") from None
    host, port = sock.getsockname()[:2]
    adapters = f", adapters {', '.join(served.adapters.names[1:])}" if args.adapter else ""
    print(f"tformer serve: {served.name} ({served.kind}{adapters}) on http://{host}:{port}/v1", file=sys.stderr,
          flush=True)
    state = app.state.tformer

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            """SIGTERM: stop taking requests, let the running ones finish, exit 0 (uvicorn would
            re-raise the signal after shutting down, which exits 143)."""
            state.draining = True
            if sig == signal.SIGTERM:
                self.should_exit = True
                return
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=args.grace, lifespan="on")
    server = Server(config)
    server.run(sockets=[sock])
    if not server.started:      # start-up failed (uvicorn printed why): e.g. no memory for the KV-cache pool
        raise ConfigError("the server did not start (see above; out of memory? lower --max-batch)")
    return 0
