"""`tformer bench` (placeholder until its issue lands)."""

from tformer.cli import COMMANDS
from tformer.errors import TformerError


def register(sub) -> None:
    p = sub.add_parser("bench", help=COMMANDS["bench"], description=COMMANDS["bench"])
    p.set_defaults(func=run)


def run(args) -> int:
    raise TformerError("`tformer bench` is not available yet")
