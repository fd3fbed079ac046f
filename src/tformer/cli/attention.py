"""`tformer attention`: draw a model's attention for one text.

    tformer attention --model runs/shakespeare --text "To be, or not to be" --out attn
    tformer attention --model runs/numbers --text "vingt et un" --target "twenty-one" --out attn

writes attn.png (a grid of heatmaps: one row per layer, one column per head, for every kind of
attention the model has) and attn.html (an interactive page that opens from disk with no network:
pick the attention kind, layer and head; hover a token to see what it attends to).
"""

from __future__ import annotations

from pathlib import Path

from tformer.cli import COMMANDS


def register(sub) -> None:
    p = sub.add_parser("attention", help=COMMANDS["attention"],
                       description=COMMANDS["attention"] + ": PATH.png (layers x heads heatmaps) and "
                       "PATH.html (a self-contained interactive explorer)")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint or run directory (its newest checkpoint), with its tokenizer.json; "
                        "an imported Hugging Face model (tformer import-hf) works too")
    p.add_argument("--text", required=True, help="the input text (for an encoder-decoder: the source)")
    p.add_argument("--target", default=None,
                   help="encoder-decoder only: the target text the decoder reads (default: the model's own "
                        "greedy translation of --text)")
    p.add_argument("--out", default="attention", metavar="PATH",
                   help="output path without extension: writes PATH.png and PATH.html; a .png or .html "
                        "extension is dropped (default: %(default)s)")
    p.set_defaults(func=run)


def output_paths(out: str) -> tuple[Path, Path]:
    """PATH -> (PATH.png, PATH.html); a given .png/.html extension is replaced, not doubled."""
    base = Path(out)
    if base.suffix.lower() in (".png", ".html", ".htm"):
        base = base.with_suffix("")
    if not base.name:
        from tformer.errors import TformerError
        raise TformerError(f"--out {out!r} has no file name (give e.g. --out attn)")
    return base.with_name(base.name + ".png"), base.with_name(base.name + ".html")


def run(args) -> int:
    from tformer.checkpoints.format import load, load_source_tokenizer, load_tokenizer
    from tformer.inspect.trace import attention_maps, prepare
    from tformer.inspect.viz import check_parent, plot_attention_grid, write_attention_html

    png, html = output_paths(args.out)
    check_parent(png)  # fail before the (slow) model load
    tokenizer = load_tokenizer(args.model)
    model = load(args.model)
    inputs = prepare(model, tokenizer, args.text, args.target, source_tokenizer=load_source_tokenizer(args.model))
    maps = attention_maps(model, inputs)
    cfg = model.cfg
    subtitle = (f"{args.model} · {type(model).__name__} ({model.kind}) · {cfg.n_layers} layers × "
                f"{cfg.n_heads} heads, d_model {cfg.d_model}")
    plot_attention_grid(maps, png)
    write_attention_html(maps, html, title=f"attention: {args.text[:80]}", subtitle=subtitle)
    print(f"wrote {png} ({sum(m.n_layers for m in maps)} rows of layers × {cfg.n_heads} heads)")
    print(f"wrote {html} (open it in a browser: pick layer and head, hover a token)")
    return 0
