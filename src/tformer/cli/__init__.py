"""The `tformer` command: a thin layer over the API, one module per subcommand.

Each module `tformer/cli/<command>.py` defines `register(subparsers)`, which adds its parser and
sets `func=run`, with `run(args) -> int | None`. Heavy imports happen inside `run`, so `--help`
stays fast. Error policy (one place, here):
  - TformerError (bad input the user can fix)  -> `error: <what> (<how to fix>)`, exit 2
  - bad flags (argparse)                       -> `error: ...`, exit 2
  - Ctrl-C                                     -> exit 130
  - OSError naming a file (no permission, no space, a file where a folder should be) -> `error: ...`, exit 2
  - out of memory                              -> `error: out of memory ...`, exit 2
  - anything else (a bug)                      -> short message + path of the saved traceback, exit 1
`--debug` shows tracebacks instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import traceback

COMMANDS = {
    "train": "train a model (language model, classifier or translator)",
    "generate": "continue a prompt with a trained decoder",
    "classify": "label texts with a trained classifier",
    "translate": "translate lines with a trained encoder-decoder",
    "tag": "label each word of texts with a trained tagger (named entities)",
    "eval": "evaluate a checkpoint on held-out data",
    "attention": "draw attention maps (PNG grid + interactive HTML)",
    "trace": "print the path of one input through the model, with shapes",
    "import-hf": "convert a Hugging Face checkpoint directory to tformer",
    "export-hf": "convert a tformer checkpoint to a Hugging Face directory",
    "import-gguf": "convert a GGUF file (llama.cpp; gpt2 or llama) to a tformer checkpoint",
    "export-gguf": "write a decoder checkpoint as a GGUF file for llama.cpp (f32, f16 or q8_0)",
    "bench": "benchmark tformer against Hugging Face and the machine's limits",
    "serve": "serve a checkpoint over HTTP with OpenAI's API (continuous batching)",
    "chat": "talk with a chat model in the terminal, replies streamed",
    "info": "show the versions, the CPU and whether tformer's C kernels are in use",
}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print the usage block too)
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="tformer", description="The Transformer family: train, run, inspect.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"tformer {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    for name in COMMANDS:
        module = importlib.import_module(f"tformer.cli.{name.replace('-', '_')}")
        module.register(sub)
    return parser


def _version() -> str:
    from tformer import __version__
    return __version__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    from tformer.errors import TformerError

    try:
        return args.func(args) or 0
    except TformerError as e:
        if args.debug:
            raise
        sys.stderr.write(f"error: {_one_line(e)}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except BrokenPipeError:  # e.g. `tformer generate ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        if args.debug or not e.filename:
            return _internal_error(e, args.debug)
        # A file the system refused (no space, no permission, a file where a folder should be):
        # the user's environment, not a bug.
        where = e.filename + (f" -> {e.filename2}" if e.filename2 else "")
        sys.stderr.write(f"error: {where}: {e.strerror or type(e).__name__} (check the path, its permissions "
                         "and free space)\n")
        return 2
    except Exception as e:
        if not args.debug and _out_of_memory(e):  # the pre-checks (tformer.inference.limits) are lower bounds
            sys.stderr.write(f"error: out of memory: {_one_line(e)[:200]} (lower --batch-size or --num-beams, "
                             "or shorten the input)\n")
            return 2
        return _internal_error(e, args.debug)


def _out_of_memory(e: BaseException) -> bool:
    import torch

    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or \
        (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def _internal_error(e: BaseException, debug: bool) -> int:
    """A bug: one line naming the file that holds the full traceback; with --debug, the traceback.
    Called inside an `except` block, so bare `raise` and print_exc see the exception being handled."""
    if debug:
        raise
    fd, path = tempfile.mkstemp(prefix="tformer-crash-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        traceback.print_exc(file=f)
    sys.stderr.write(f"error: internal error {type(e).__name__}: {_one_line(e)} "
                     f"(full traceback in {path}; rerun with --debug, and please report it)\n")
    return 1


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
