"""`tformer import-hf` (placeholder until its issue lands)."""

from tformer.cli import COMMANDS
from tformer.errors import TformerError


def register(sub) -> None:
    p = sub.add_parser("import-hf", help=COMMANDS["import-hf"], description=COMMANDS["import-hf"])
    p.set_defaults(func=run)


def run(args) -> int:
    raise TformerError("`tformer import-hf` is not available yet")
