"""`tformer train` (placeholder until its issue lands)."""

from tformer.cli import COMMANDS
from tformer.errors import TformerError


def register(sub) -> None:
    p = sub.add_parser("train", help=COMMANDS["train"], description=COMMANDS["train"])
    p.set_defaults(func=run)


def run(args) -> int:
    raise TformerError("`tformer train` is not available yet")
