"""`tformer classify` (placeholder until its issue lands)."""

from tformer.cli import COMMANDS
from tformer.errors import TformerError


def register(sub) -> None:
    p = sub.add_parser("classify", help=COMMANDS["classify"], description=COMMANDS["classify"])
    p.set_defaults(func=run)


def run(args) -> int:
    raise TformerError("`tformer classify` is not available yet")
