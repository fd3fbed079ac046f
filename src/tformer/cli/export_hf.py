"""`tformer export-hf` (placeholder until its issue lands)."""

from tformer.cli import COMMANDS
from tformer.errors import TformerError


def register(sub) -> None:
    p = sub.add_parser("export-hf", help=COMMANDS["export-hf"], description=COMMANDS["export-hf"])
    p.set_defaults(func=run)


def run(args) -> int:
    raise TformerError("`tformer export-hf` is not available yet")
