"""The chat page at GET /: one static file shipped as package data; in a real browser (headless
Chromium, Debian's `chromium`, driven by Playwright with its executable path) it lists the model,
streams an answer that grows chunk by chunk and ends as the API's own answer to the same settings,
and in JSON mode shows the API's JSON-mode answer (structured outputs) to the same conversation.
Screenshots go to the test's tmp dir."""

import json
import shutil
import string
import tempfile
from pathlib import Path

import pytest

from serve_util import httpx, save_tiny, serving
from tformer.data.tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]
# the turns in plain text (no special tokens: the tiny model has none); printable ASCII, so JSON can be written
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} says {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant says {% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("page") / "chat", "decoder", positional="rope", max_seq_len=256,
                     tokenizer=Tokenizer.char(string.printable))
    (path / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return path


def test_the_page_is_served_and_shipped(chat_model):
    tomllib = pytest.importorskip("tomllib")                   # Python 3.11+
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.html" in package_data["tformer.serve"]
    assert (ROOT / "src/tformer/serve/chat.html").is_file()
    with serving(chat_model) as (base, _):
        r = httpx.get(f"{base}/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in r.headers["content-security-policy"]
        assert r.text == (ROOT / "src/tformer/serve/chat.html").read_text(encoding="utf-8")
        assert "/" not in httpx.get(f"{base}/openapi.json").json()["paths"]
        assert 'endpoint="/",status="200"' in httpx.get(f"{base}/metrics").text


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (run `make system-deps`, which installs "
                    "the Debian package `chromium`)")
def test_the_chat_page_streams_an_answer_in_chromium(chat_model, tmp_path):
    from playwright.sync_api import sync_playwright

    settings = dict(temperature=0, top_p=1, max_tokens=40)
    system, question = "be brief.", "hello, who are you?"
    with serving(chat_model) as (base, _), sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        expected = httpx.post(f"{base}/v1/chat/completions", json={"model": "chat", "messages": messages,
                                                                   **settings}).json()
        # the JSON-mode turn that follows, as the page will send it (the conversation so far + the question)
        turn = [*messages, {"role": "assistant", "content": expected["choices"][0]["message"]["content"]},
                {"role": "user", "content": "answer in json"}]
        as_json = httpx.post(f"{base}/v1/chat/completions", json={"model": "chat", "messages": turn, **settings,
                                                                  "response_format": {"type": "json_object"}},
                             timeout=120)          # the first JSON request reads the vocabulary for the grammar
        browser = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True, args=FLAGS,
                                                        viewport={"width": 1100, "height": 700})
        try:
            page = browser.new_page()
            problems = []
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") and "Failed to load resource" not in m.text else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(f"{base}/")
            page.wait_for_selector('#model option[value="chat"]', state="attached")
            page.fill("#system", system)
            for name, value in settings.items():
                page.fill(f"#{name}", str(value))
            # count the answer's updates: it must grow in several steps, not arrive whole
            page.evaluate("""() => { window.updates = 0; new MutationObserver((records) => {
                for (const r of records) if (r.target.closest && r.target.closest('.msg.assistant')) window.updates++;
              }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true}); }""")
            page.fill("#input", question)
            page.click("#send")
            page.wait_for_selector(".msg.assistant[data-finish]", timeout=30_000)
            answer = page.text_content(".msg.assistant")
            assert answer == expected["choices"][0]["message"]["content"] and len(answer) > 5
            assert page.get_attribute(".msg.assistant", "data-finish") == "length"
            assert page.evaluate("window.updates") >= 5
            assert "40 tokens" in page.text_content("#status")
            assert page.text_content(".msg.user") == question
            shot = tmp_path / "chat_page.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")

            # JSON mode: the request carries response_format json_object; the answer is the API's JSON-mode
            # answer (a random model's JSON string may run to max_tokens: then it is JSON cut short)
            assert as_json.status_code == 200, as_json.text
            json_answer = as_json.json()["choices"][0]
            page.check("#json_mode")
            page.fill("#input", "answer in json")
            page.click("#send")
            page.locator(".msg.assistant[data-finish]").nth(1).wait_for(timeout=30_000)
            shown = page.locator(".msg.assistant").nth(1)
            assert shown.text_content() == json_answer["message"]["content"] and shown.text_content().startswith("{")
            assert shown.get_attribute("data-finish") == json_answer["finish_reason"]
            if json_answer["finish_reason"] == "stop":
                assert isinstance(json.loads(shown.text_content()), dict)
            assert page.is_hidden("#error")
            shot = tmp_path / "chat_page_json_mode.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")
            assert not problems, problems
        finally:
            browser.close()
