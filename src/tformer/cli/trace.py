"""`tformer trace` (placeholder until its issue lands)."""

from tformer.cli import COMMANDS
from tformer.errors import TformerError


def register(sub) -> None:
    p = sub.add_parser("trace", help=COMMANDS["trace"], description=COMMANDS["trace"])
    p.set_defaults(func=run)


def run(args) -> int:
    raise TformerError("`tformer trace` is not available yet")
