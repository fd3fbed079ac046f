"""The attention explorer in a real browser: headless Chromium (Debian's `chromium` package, driven
by Playwright with its executable path; `make system-deps` installs it) opens the page from disk,
finds one control per layer and per head, switches head, hovers a token, and sees the highlighted
weights change to the model's α — with no console errors."""

import shutil
import tempfile

import pytest
import torch

from tformer import EncoderDecoder, ModelConfig
from tformer.data.tokenizers import Tokenizer
from tformer.inspect.trace import attention_maps, prepare
from tformer.inspect.viz import write_attention_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (run `make system-deps`, "
                                "which installs the Debian package `chromium`)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]


@pytest.fixture(scope="module")
def page_and_maps(tmp_path_factory):
    tok = Tokenizer.char("the cat sat le chat")
    cfg = ModelConfig(kind="encoder-decoder", vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_layers=2,
                      d_ff=48, max_seq_len=32, dropout=0.0, decoder_start_token_id=tok.bos_id)
    torch.manual_seed(0)
    model = EncoderDecoder(cfg).eval()
    for p in model.parameters():  # peaked attention: every head and query has its own distinct pattern
        p.data.mul_(6.0)
    maps = attention_maps(model, prepare(model, tok, "the cat sat", target="le chat"))
    path = tmp_path_factory.mktemp("explorer") / "attn.html"
    write_attention_html(maps, path, title="test page")

    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        browser = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                        args=FLAGS, viewport={"width": 1100, "height": 900})
        try:
            page = browser.new_page()
            problems = []
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(path.as_uri())
            yield page, maps, problems
        finally:
            browser.close()


def key_weights(page):
    return [float(w) for w in page.eval_on_selector_all("#keys .tok", "els => els.map(e => e.dataset.weight)")]


def test_explorer_controls_hover_and_causal_triangle(page_and_maps):
    page, maps, problems = page_and_maps
    enc, dec, cross = maps
    assert page.locator("#kinds [data-kind]").count() == 3
    assert page.locator("#layers [data-layer]").count() == enc.n_layers
    assert page.locator("#heads [data-head]").count() == enc.n_heads

    page.hover('#queries .tok[data-index="2"]')
    before = key_weights(page)
    assert before == pytest.approx(enc.weights[0][0][2], abs=1e-3)
    page.click('#heads [data-head="1"]')
    assert page.get_attribute('#heads [data-head="1"]', "aria-pressed") == "true"
    page.hover('#queries .tok[data-index="4"]')
    page.hover('#queries .tok[data-index="2"]')
    after = key_weights(page)
    assert after == pytest.approx(enc.weights[0][1][2], abs=1e-3)
    assert max(abs(a - b) for a, b in zip(before, after)) > 0.05   # the highlight really changed
    page.click('#layers [data-layer="1"]')
    page.hover('#queries .tok[data-index="5"]')
    assert key_weights(page) == pytest.approx(enc.weights[1][1][5], abs=1e-3)

    # decoder self-attention: the causal triangle is drawn, and the keys after the hovered query are masked
    page.click('#kinds [data-kind="1"]')
    T = len(dec.query_tokens)
    assert page.locator("#matrix td.masked").count() == T * (T - 1) // 2
    page.hover('#queries .tok[data-index="2"]')
    assert page.locator("#keys .tok.masked").count() == T - 3
    # cross-attention: target tokens query the source tokens
    page.click('#kinds [data-kind="2"]')
    assert page.locator("#keys .tok").all_text_contents()[0].startswith(cross.key_tokens[0])
    page.hover('#queries .tok[data-index="1"]')
    assert key_weights(page) == pytest.approx(cross.weights[1][1][1], abs=1e-3)
    assert page.locator("#matrix td.masked").count() == 0
    assert problems == []
