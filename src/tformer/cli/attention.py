"""`tformer attention` (placeholder until its issue lands)."""

from tformer.cli import COMMANDS
from tformer.errors import TformerError


def register(sub) -> None:
    p = sub.add_parser("attention", help=COMMANDS["attention"], description=COMMANDS["attention"])
    p.set_defaults(func=run)


def run(args) -> int:
    raise TformerError("`tformer attention` is not available yet")
