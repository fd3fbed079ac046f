"""`tformer train` with fields of a model preset overridden, for recipe searches on shapes the flags do not
reach (the norm's place, the positions, the embedding scale, ...):

    python benchmarks/train_variant.py nmt-mini '{"embed_scale": true}' --task translate --data bible-en-es \
        --max-steps 500 --out runs/escale

The first argument names the preset, the second is a JSON object of ModelConfig fields laid over it; the
rest goes to `tformer train` unchanged, and the run's config.json records the shape it trained.
"""

import json
import sys

from tformer.cli import main
from tformer.model import config

if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    name, fields = sys.argv[1], sys.argv[2]
    if name not in config.PRESETS:
        sys.exit(f"error: unknown preset {name!r}; choose one of {', '.join(config.PRESETS)}")
    try:
        config.PRESETS[name].update(json.loads(fields))
    except (ValueError, TypeError) as e:
        sys.exit(f"error: the fields must be a JSON object, like '{{\"embed_scale\": true}}' ({e})")
    sys.exit(main(["train", *sys.argv[3:]]))
