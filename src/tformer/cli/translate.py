"""`tformer translate` (placeholder until its issue lands)."""

from tformer.cli import COMMANDS
from tformer.errors import TformerError


def register(sub) -> None:
    p = sub.add_parser("translate", help=COMMANDS["translate"], description=COMMANDS["translate"])
    p.set_defaults(func=run)


def run(args) -> int:
    raise TformerError("`tformer translate` is not available yet")
