"""Plots: training loss, confusion matrix, attention grids (PNG) and the attention explorer (HTML).

matplotlib is imported lazily (only the plotting functions need it) with the non-interactive Agg
backend, so plotting works on machines without a display and never opens a window.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError, TformerError


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:  # an optional dependency: say how to get it
        raise TformerError("plotting needs matplotlib (pip install 'tformer[plot]')") from e
    matplotlib.use("Agg")  # no display needed; must come before pyplot is imported
    import matplotlib.pyplot as plt
    return plt


def check_parent(path) -> Path:
    """The output's folder must exist: we never create folders the user did not ask for."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise TformerError(f"cannot write {path}: {parent} is a file, not a folder (choose another path)")
    if not parent.is_dir():
        raise TformerError(f"cannot write {path}: folder {parent} does not exist (create it first)")
    return path


def _save(fig, path: Path, dpi: int = 100) -> None:
    """Write to a temporary file then rename, so a failed save never leaves half a PNG behind."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or "png")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
        fig.clf()
        import matplotlib.pyplot as plt
        plt.close(fig)


def plot_loss(records: list[dict], path) -> None:
    """Training (and validation) loss against step, from metrics.jsonl records.

    Each record may carry `train_loss` and/or `val_loss` (a record without either is skipped), so
    the same list that train.py appends to metrics.jsonl can be passed as is.
    """
    path = check_parent(path)
    plt = _pyplot()
    train = [(r["step"], r["train_loss"]) for r in records if r.get("train_loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    if train:
        ax.plot(*zip(*train), label="train", color="tab:blue", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), label="validation", color="tab:orange", marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats)")
    ax.set_title("loss" if train or val else "loss (no records yet)")
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    fig.tight_layout()
    _save(fig, path)


def plot_confusion(matrix: list[list[int]], labels: list[str], path) -> None:
    """Confusion matrix: rows = true label, columns = predicted label, counts written in the cells."""
    n = len(labels)
    if len(matrix) != n or any(len(row) != n for row in matrix):
        raise DataError(f"confusion matrix must be {n}x{n} for {n} labels "
                        f"(got {len(matrix)} rows of lengths {[len(r) for r in matrix]})")
    path = check_parent(path)
    plt = _pyplot()
    size = 2.5 + 0.6 * n
    fig, ax = plt.subplots(figsize=(size, size))
    im = ax.imshow(matrix, cmap="Blues")
    top = max((max(row) for row in matrix), default=0)
    for i in range(n):
        for j in range(n):
            # dark text on light cells, light text on dark cells
            color = "white" if top and matrix[i][j] > top / 2 else "black"
            ax.text(j, i, str(matrix[i][j]), ha="center", va="center", color=color)
    ax.set_xticks(range(n), labels, rotation=45, ha="right")
    ax.set_yticks(range(n), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    total = sum(map(sum, matrix))
    correct = sum(matrix[i][i] for i in range(n))
    ax.set_title(f"confusion (accuracy {correct / total:.1%} of {total})" if total else "confusion")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    _save(fig, path)


# ----------------------------------------------------------------------------- attention maps

@dataclass
class AttentionMap:
    """One kind of attention (e.g. decoder self-attention) for one input, ready to draw.

    weights: per layer, a nested list (H, T_q, T_k) of α (each query's row sums to 1).
    `causal` marks decoder self-attention, whose keys j > i are masked (the causal triangle).
    """

    name: str
    weights: list
    query_tokens: list[str]
    key_tokens: list[str]
    causal: bool = False

    @property
    def n_layers(self) -> int:
        return len(self.weights)

    @property
    def n_heads(self) -> int:
        return len(self.weights[0]) if self.weights else 0


def _as_maps(maps) -> list[AttentionMap]:
    maps = [maps] if isinstance(maps, AttentionMap) else list(maps)
    if not maps or any(m.n_layers == 0 for m in maps):
        raise DataError("no attention weights to draw (the model returned none)")
    return maps


def grid_shape(maps) -> tuple[int, int]:
    """(rows, columns) of panels in the PNG: one row per layer of every map, one column per head."""
    maps = _as_maps(maps)
    return sum(m.n_layers for m in maps), max(m.n_heads for m in maps)


def plot_attention_grid(maps, path, panel_px: int | None = None, dpi: int = 100) -> None:
    """Heatmaps of α, one panel per (layer, head): rows = layers (of each map in turn), columns =
    heads; query tokens down the first column, key tokens under the last layer of each map;
    0 dark, 1 bright (viridis). Masked positions (the causal triangle) have α = 0, so they are dark.

    Every panel is exactly `panel_px` x `panel_px` pixels, placed by `layout`, so the image size is
    predictable; by default the panel grows with the number of tokens so that labels fit.
    """
    maps = _as_maps(maps)
    path = check_parent(path)
    _, cols = grid_shape(maps)
    longest = max(max(len(m.query_tokens), len(m.key_tokens)) for m in maps)
    if panel_px is None:
        panel_px = max(120, 11 * longest)
    chars = max(len(t) for m in maps for t in m.query_tokens + m.key_tokens)
    lay = layout([m.n_layers for m in maps], cols, panel_px, label_px=min(160, 24 + 6 * chars))
    fontsize = max(4, min(8, int(panel_px / longest * 0.8)))
    plt = _pyplot()
    fig = plt.figure(figsize=(lay["width"] / dpi, lay["height"] / dpi), dpi=dpi)
    for s, m in enumerate(maps):
        for layer in range(m.n_layers):
            for head in range(m.n_heads):
                ax = fig.add_axes(lay["panel"](s, layer, head))
                ax.imshow(m.weights[layer][head], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto",
                          interpolation="nearest")
                # tick labels only on the outer panels: thousands of empty ticks would make drawing slow
                if head == 0:
                    ax.set_yticks(range(len(m.query_tokens)), m.query_tokens, fontsize=fontsize)
                else:
                    ax.set_yticks([])
                if layer == m.n_layers - 1:
                    ax.set_xticks(range(len(m.key_tokens)), m.key_tokens, fontsize=fontsize, rotation=90)
                else:
                    ax.set_xticks([])
                ax.tick_params(length=0)
                if head == 0:
                    ax.set_ylabel(f"layer {layer}", fontsize=8)
                if layer == 0:
                    ax.set_title(f"head {head}", fontsize=8)
        left, bottom, _, height = lay["panel"](s, 0, 0)
        fig.text(left, bottom + height + lay["title_frac"], m.name, fontsize=9, weight="bold", va="bottom")
    fig.suptitle("attention weights α  (row = query i, column = key j;  dark 0 → bright 1)", fontsize=9,
                 x=0.01, ha="left", y=1 - 4 / lay["height"], va="top")
    _save(fig, path, dpi=dpi)


def layout(section_rows: list[int], cols: int, panel_px: int, label_px: int = 80) -> dict:
    """Pixel layout of the attention grid. Sections (one per attention map) are stacked, each with
    a title line above and `label_px` of room below for the key labels; inside a section panels are
    `gap` pixels apart. `panel(section, row, col)` gives matplotlib's (left, bottom, width, height)
    figure fractions of one panel."""
    gap, top, title = 8, 24, 36                             # title: section name + "head h" line
    left = label_px + 20                                    # query labels + the "layer n" label
    width = left + cols * panel_px + (cols - 1) * gap + 12
    section_h = [title + r * panel_px + (r - 1) * gap + label_px for r in section_rows]
    height = top + sum(section_h)

    def panel(section: int, row: int, col: int) -> tuple[float, float, float, float]:
        y_top = top + sum(section_h[:section]) + title + row * (panel_px + gap)
        x = left + col * (panel_px + gap)
        return (x / width, (height - y_top - panel_px) / height,        # figure coords run bottom-up
                panel_px / width, panel_px / height)

    return {"width": width, "height": height, "panel": panel, "title_frac": (title - 14) / height}


PLACEHOLDER = "__TFORMER_ATTENTION_DATA__"


def write_attention_html(maps, path, title: str = "attention explorer", subtitle: str = "") -> None:
    """The interactive explorer: `attention_explorer.html` with the weights inlined as JSON, so the
    page opens from disk with no network and no other files."""
    from importlib.resources import files

    maps = _as_maps(maps)
    path = check_parent(path)
    template = files("tformer.inspect").joinpath("attention_explorer.html").read_text(encoding="utf-8")
    data = {"title": title, "subtitle": subtitle, "maps": [
        {"name": m.name, "causal": m.causal, "query_tokens": m.query_tokens, "key_tokens": m.key_tokens,
         "weights": _round(m.weights)} for m in maps]}
    # ASCII-only JSON with <, >, & escaped: the text can never close the <script> element it sits in
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"))
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(template.replace(PLACEHOLDER, text), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _round(x, digits: int = 4):
    """Nested lists of floats with `digits` decimals (keeps the page small)."""
    return [_round(v, digits) for v in x] if isinstance(x, (list, tuple)) else round(float(x), digits)
