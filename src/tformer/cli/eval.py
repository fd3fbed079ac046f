"""`tformer eval` (placeholder until its issue lands)."""

from tformer.cli import COMMANDS
from tformer.errors import TformerError


def register(sub) -> None:
    p = sub.add_parser("eval", help=COMMANDS["eval"], description=COMMANDS["eval"])
    p.set_defaults(func=run)


def run(args) -> int:
    raise TformerError("`tformer eval` is not available yet")
