"""Helpers that several commands share: reading input lines, loading a task's checkpoint, and
refusing to overwrite a destination. A command imports these from here, never from a sibling command."""

from __future__ import annotations

import sys
from pathlib import Path

from tformer.errors import CheckpointError, DataError, TformerError


def read_inputs(texts: list[str], what: str = "text") -> list[str]:
    """The texts from the command line, else the lines of stdin; an empty one is an error (it would
    silently shift every later output line against its input)."""
    if not texts:
        if sys.stdin.isatty():
            raise DataError(f"no input: give {what}s as arguments or pipe lines on stdin")
        texts = sys.stdin.read().splitlines()
        where = "line"
    else:
        where = "argument"
    for i, t in enumerate(texts, 1):
        if not t.strip():
            raise DataError(f"{where} {i} is empty (every input {what} must have some text)")
    if not texts:
        raise DataError("no input: stdin was empty")
    return texts


def load_task_model(path: str, kind: str, what: str, task: str):
    """(model, tokenizer, max_len, meta) of a checkpoint that must hold a model of `kind`
    (model.kind; `what` in messages)."""
    from tformer.checkpoints.format import load, load_tokenizer, read_config

    model = load(path)
    if model.kind != kind:
        raise CheckpointError(f"{path} holds a {type(model).__name__}, not {what} "
                              f"(train one with `tformer train --task {task}`)")
    tokenizer = load_tokenizer(path)
    meta = read_config(path).get("meta", {})
    max_len = min(int(meta.get("max_len", model.cfg.max_seq_len)), model.cfg.max_seq_len)
    return model, tokenizer, max_len, meta


DTYPES = ("fp32", "bf16")       # --dtype: the weights' dtype while a command runs the model


def add_dtype_flag(p) -> None:
    """--dtype, the weights' dtype for `tformer serve`, `generate` and `chat` (model_dtype reads it)."""
    p.add_argument("--dtype", choices=DTYPES, default="fp32",
                   help="the weights' dtype: fp32 (a checkpoint stored in bf16 is widened), or bf16: half the memory "
                        "and the bytes a decoding step reads, the products on bf16 units where the CPU has them "
                        "(AVX-512 BF16, AMX); outputs rounded to bf16's 8 significant bits (default %(default)s)")


def model_dtype(name: str, device: str | None = None):
    """--dtype's value -> what checkpoints.format.load takes (None: fp32, as stored for training), with a
    warning where `device` (default the CPU) has no bf16 units (bf16 products are then slower than fp32's)."""
    import torch

    from tformer.devices import native_bf16
    from tformer.errors import warn

    if name == "fp32":
        return None
    if not native_bf16(torch.device(device or "cpu")):
        warn(f"--dtype bf16: {device or 'this CPU'} has no bf16 units (a CPU's AVX-512 BF16 or AMX); bf16 products "
             "are slower than fp32's there (the memory is still halved)")
    return torch.bfloat16


def check_destination(src: Path, dst: Path, force: bool) -> None:
    """Never overwrite what the user has, unless asked; never replace the source with its copy."""
    if dst.exists() and not dst.is_dir():
        raise TformerError(f"{dst} exists and is not a directory (choose another DST)")
    above = next((p for p in dst.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise TformerError(f"cannot create {dst}: {above} is a file, not a directory (choose another DST)")
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise TformerError(f"DST {dst} is the same directory as SRC (choose another DST)")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise TformerError(f"{dst} exists and is not empty (pass --force to replace it)")


def check_file_destination(src: Path, dst: Path, force: bool) -> None:
    """As check_destination, for a command that writes one file (a .gguf)."""
    if dst.is_dir():
        raise TformerError(f"{dst} is a directory (give the path of the file to write)")
    above = next((p for p in dst.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise TformerError(f"cannot create {dst}: {above} is a file, not a directory (choose another path)")
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise TformerError(f"{dst} is SRC itself (choose another path)")
    if dst.exists() and not force:
        raise TformerError(f"{dst} exists (pass --force to replace it)")


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p")    # what only sampling reads (argparse's dests)


def add_sampling_flags(p, defaults, max_new_tokens_help: str) -> None:
    """The sampling flags `tformer generate` and `tformer chat` share, with `defaults` (a
    generation.settings.Defaults) shown in --help; --max-new-tokens defaults to None (the caller's rule),
    and so do SAMPLING_FLAGS, so that a flag given can be told from its default (sampling_options fills them)."""
    from tformer.cli.args import nonneg_float, nonneg_int, positive_float, probability, seed, unit_open_closed

    p.add_argument("--max-new-tokens", type=nonneg_int, default=None, metavar="N", help=max_new_tokens_help)
    p.add_argument("--temperature", type=nonneg_float, default=None, metavar="T",
                   help="divide the logits by T before sampling: <1 sharper, >1 more random, 0 = greedy "
                        f"(default {defaults.temperature})")
    p.add_argument("--top-k", type=nonneg_int, default=None, metavar="K",
                   help=f"sample only among the K most likely tokens; 0 = off (default {defaults.top_k})")
    p.add_argument("--top-p", type=unit_open_closed, default=None, metavar="P",
                   help="sample only among the most likely tokens holding probability P, in (0, 1]; 1 = off "
                        f"(default {defaults.top_p})")
    p.add_argument("--min-p", type=probability, default=None, metavar="P",
                   help=f"drop tokens less likely than P times the most likely one (default {defaults.min_p or 'off'})")
    p.add_argument("--repetition-penalty", type=positive_float, default=defaults.repetition_penalty, metavar="R",
                   help="make tokens already in the text less likely; 1 = off, 1.1-1.3 is typical "
                        "(default %(default)g)")
    p.add_argument("--seed", type=seed, default=None,
                   help="random seed: the same seed gives the same text (default: random)")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (no sampling)")


def apply_only_to(flags: list[str], what: str, rest: str) -> str:
    """The one-line message for flags given where they would be unused: "--a, --b apply to WHAT" + rest, where
    rest may name them as {it}."""
    one = len(flags) == 1
    rest = rest.replace("{it}", "it" if one else "them")
    return f"{', '.join(flags)} {'applies' if one else 'apply'} to {what}{rest}"


def sampling_given(args) -> list[str]:
    """The sampling-only flags given on the command line (and --seed), as the user wrote them."""
    given = [name for name in SAMPLING_FLAGS if getattr(args, name) is not None]
    return ["--" + name.replace("_", "-") for name in given + (["seed"] if args.seed is not None else [])]


def sampling_options(args, defaults) -> dict:
    """generate()'s sampling arguments from add_sampling_flags' flags, `defaults` where not given."""
    options = {name: getattr(defaults, name) if getattr(args, name) is None else getattr(args, name)
               for name in SAMPLING_FLAGS}
    return dict(do_sample=not args.greedy, repetition_penalty=args.repetition_penalty, **options)
