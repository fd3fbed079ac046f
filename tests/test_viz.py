"""Plots: loss and confusion PNGs, the attention grid's panel layout, the explorer page's content."""

import json
import re

import numpy as np
import pytest

from tformer.errors import DataError, TformerError
from tformer.inspect.viz import (
    AttentionMap,
    grid_shape,
    layout,
    plot_attention_grid,
    plot_confusion,
    plot_loss,
    write_attention_html,
)

mpimg = pytest.importorskip("matplotlib.image")


def random_map(name, layers, heads, tq, tk, causal=False, seed=0):
    """Rows of α that sum to 1 (zero above the diagonal when causal), as nested lists."""
    rng = np.random.default_rng(seed)
    w = rng.random((layers, heads, tq, tk)) + 0.05
    if causal:
        w = w * np.tril(np.ones((tq, tk)))
    w = w / w.sum(-1, keepdims=True)
    toks = [f"t{i}" for i in range(max(tq, tk))]
    return AttentionMap(name, w.tolist(), toks[:tq], toks[:tk], causal)


def runs(flags):
    """Lengths of the runs of True in a 1-D bool array."""
    edges = np.diff(np.concatenate([[0], flags.astype(int), [0]]))
    return (np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).tolist()


def test_loss_and_confusion_pngs(tmp_path):
    records = [{"step": s, "train_loss": 3.0 / (s + 1)} for s in range(20)] + [{"step": 19, "val_loss": 0.4}]
    plot_loss(records, tmp_path / "loss.png")
    plot_confusion([[5, 1], [2, 7]], ["fresh", "rotten"], tmp_path / "confusion.png")
    for name in ("loss.png", "confusion.png"):
        img = mpimg.imread(tmp_path / name)
        assert img.ndim == 3 and min(img.shape[:2]) > 100
    with pytest.raises(DataError, match="2x2"):
        plot_confusion([[1, 2, 3]], ["a", "b"], tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_missing_output_folder_is_a_clear_error(tmp_path):
    m = random_map("self-attention", 1, 1, 3, 3)
    for call in (lambda p: plot_loss([], p), lambda p: plot_attention_grid(m, p),
                 lambda p: write_attention_html(m, p)):
        with pytest.raises(TformerError, match="does not exist"):
            call(tmp_path / "missing" / "out.png")


def test_attention_grid_has_one_panel_per_layer_and_head(tmp_path):
    """Read the PNG back: the coloured (viridis) pixels form exactly layers x heads square panels of
    the requested size, and the image has the size the layout promises."""
    maps = [random_map("encoder", 2, 3, 5, 5), random_map("decoder", 1, 3, 4, 4, causal=True, seed=1)]
    assert grid_shape(maps) == (3, 3)
    panel = 48
    plot_attention_grid(maps, tmp_path / "grid.png", panel_px=panel)
    img = mpimg.imread(tmp_path / "grid.png")[..., :3]
    lay = layout([2, 1], 3, panel, label_px=24 + 6 * 2)  # the longest label, "t4", has 2 characters
    assert img.shape[:2] == (lay["height"], lay["width"])
    colour = (img.max(-1) - img.min(-1)) > 0.2  # viridis is saturated; text, frames and background are grey
    col_runs, row_runs = runs(colour.any(0)), runs(colour.any(1))
    assert len(col_runs) == 3 and all(abs(r - panel) <= 2 for r in col_runs)   # 3 heads
    assert len(row_runs) == 3 and all(abs(r - panel) <= 2 for r in row_runs)   # 2 + 1 layers
    # the causal triangle: in the decoder panel the top-right cell is α = 0 (dark), the diagonal bright
    top = int(round(lay["height"] * (1 - lay["panel"](1, 0, 0)[1]))) - panel  # first pixel row of that panel
    left = int(round(lay["width"] * lay["panel"](1, 0, 0)[0]))
    cell = panel / 4
    dark = img[top + int(cell / 2), left + int(3.5 * cell)]
    first = img[top + int(cell / 2), left + int(cell / 2)]                     # α_00 = 1 in a causal row 0
    assert first.sum() > dark.sum() + 0.5


def test_explorer_page_is_self_contained_and_carries_the_weights(tmp_path):
    m = random_map("self-attention (causal)", 2, 2, 3, 3, causal=True)
    m.query_tokens[1] = m.key_tokens[1] = "</script><b>x"  # user text must stay text
    path = tmp_path / "attn.html"
    write_attention_html([m], path, title="t <i>", subtitle="s")
    html = path.read_text(encoding="utf-8")
    assert "</script><b>" not in html and "<i>" not in html
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:|#)""", html)      # nothing loaded from elsewhere
    assert "http://" not in html and "https://" not in html
    blob = re.search(r'<script id="attention-data" type="application/json">(.*?)</script>', html, re.S).group(1)
    data = json.loads(blob)
    assert data["maps"][0]["query_tokens"][1] == "</script><b>x"
    np.testing.assert_allclose(np.array(data["maps"][0]["weights"]), np.array(m.weights), atol=1e-4)
