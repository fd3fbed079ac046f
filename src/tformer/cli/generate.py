"""`tformer generate` (placeholder until its issue lands)."""

from tformer.cli import COMMANDS
from tformer.errors import TformerError


def register(sub) -> None:
    p = sub.add_parser("generate", help=COMMANDS["generate"], description=COMMANDS["generate"])
    p.set_defaults(func=run)


def run(args) -> int:
    raise TformerError("`tformer generate` is not available yet")
