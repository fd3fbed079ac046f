"""tformer serve under bad input and faults: every error is OpenAI-shaped with the right status, a
client that disconnects mid-stream frees its row, SIGTERM drains and exits 0, and fuzzing the API
from its own OpenAPI schema (schemathesis) never gets a 5xx."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

from serve_util import client, httpx, save_tiny, serving, wait_for


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("faults") / "dec", "decoder", max_seq_len=600)


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_bad_requests_get_openai_errors(decoder, tmp_path):
    with serving(decoder, max_batch=1, max_queue=2, max_body_bytes=4000) as (base, app):
        url = f"{base}/v1/completions"
        post = lambda body: httpx.post(url, json=body)                                     # noqa: E731
        error_of(httpx.post(url, content=b'{"model": "dec", "prompt": ', headers={"content-type": "application/json"}),
                 400)
        assert error_of(post({"model": "dec", "prompt": 3}), 422)["param"] == "prompt"
        assert error_of(post({"model": "dec", "prompt": "a", "max_tokens": "many"}), 422)["param"] == "max_tokens"
        assert error_of(post({"model": "gpt-9", "prompt": "a"}), 404)["code"] == "model_not_found"
        error_of(post({"model": "dec", "prompt": "a" * 5000}), 413)
        e = error_of(post({"model": "dec", "prompt": "ab" * 350}), 400)
        assert "700 tokens" in e["message"] and "context is 600" in e["message"] and e["param"] == "prompt"
        e = error_of(post({"model": "dec", "prompt": "abc", "max_tokens": 598}), 400)
        assert "max_tokens <= 597" in e["message"] and e["param"] == "max_tokens"
        error_of(post({"model": "dec", "prompt": []}), 400)
        e = error_of(httpx.post(f"{base}/v1/embeddings", json={"model": "dec", "input": "a"}), 400)
        assert "encoder" in e["message"]
        error_of(httpx.get(f"{base}/v1/nothing"), 404)
        # 2 prompts x 2 choices = 4 sequences, more than --max-queue 2 can hold
        r = post({"model": "dec", "prompt": ["a", "b"], "n": 2})
        assert error_of(r, 429)["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
        app.state.tformer.draining = True                                  # as after SIGTERM
        r = post({"model": "dec", "prompt": "a"})
        assert error_of(r, 503)["code"] == "unavailable" and r.headers["retry-after"] == "1"
        assert httpx.get(f"{base}/health").status_code == 503


def test_api_key_is_required_when_set(decoder):
    with serving(decoder, api_key="s3cret") as (base, _):
        body = {"model": "dec", "prompt": "a", "max_tokens": 2}
        error_of(httpx.post(f"{base}/v1/completions", json=body), 401)
        error_of(httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
        with pytest.raises(Exception) as e:
            client(base, "wrong").completions.create(**body)
        assert e.value.status_code == 401
        assert client(base, "s3cret").completions.create(**body).choices[0].finish_reason == "length"
        assert httpx.get(f"{base}/health").status_code == 200              # probes need no key


def test_a_client_that_disconnects_frees_its_row(decoder):
    with serving(decoder, max_batch=2) as (base, app):
        scheduler = app.state.tformer.scheduler
        body = {"model": "dec", "prompt": "a long story", "max_tokens": 580, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines), next(lines)                                        # two chunks, then hang up
            seq = scheduler.running[0]
        assert wait_for(lambda: not scheduler.running and seq.cancelled, timeout=10)
        assert len(seq.generated) < 580
        again = client(base).completions.create(model="dec", prompt="a", max_tokens=5)
        assert again.choices[0].finish_reason == "length"


def test_sigterm_finishes_running_requests_and_exits_0(decoder):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TFORMER_API_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "tformer", "serve", "--model", str(decoder), "--port", "0",
                             "--grace", "60"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        port = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line).group(1)
        base, lines, started = f"http://127.0.0.1:{port}", [], threading.Event()

        def stream():
            body = {"model": "dec", "prompt": "once", "max_tokens": 400, "stream": True, "temperature": 0}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(httpx.TransportError):                         # no new connections
            wait_for(lambda: httpx.post(f"{base}/v1/completions", json={"model": "dec", "prompt": "a"}) and False, 5)
        reader.join(120)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len("".join(c["choices"][0]["text"] for c in chunks)) > 300       # ran to the end (some tokens are "")


def test_fuzzing_the_openapi_schema_never_gets_a_5xx(tmp_path):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    path = save_tiny(tmp_path / "dec", "decoder")
    with serving(path, max_batch=4) as (base, app):
        schema = schemathesis.openapi.from_dict(app.openapi())
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            for result in schema.get_all_operations():
                operation = result.ok()
                if mode == schemathesis.GenerationMode.NEGATIVE and operation.method.upper() != "POST":
                    continue                                # nothing to get wrong in a bare GET

                # the same examples every run (CI never flakes); FUZZ_EXAMPLES=500 fuzzes deeper (minutes)
                @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 12)), deadline=None, database=None,
                          derandomize=True, suppress_health_check=list(HealthCheck))
                @given(operation.as_strategy(generation_mode=mode))
                def check(case):
                    if case.body is not None and isinstance(case.body, dict) and "model" in case.body:
                        case.body["model"] = "dec"          # reach past the model check most of the time
                    r = case.call(base_url=base, timeout=60)
                    assert r.status_code < 500, (case.method, case.path, case.body, r.status_code, r.text)

                check()


def test_cli_bad_model_or_port_is_a_one_line_error(decoder, tmp_path, capsys):
    from tformer.cli import main

    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err and err.count("\n") == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--model", str(decoder), "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot listen on 127.0.0.1:") and err.count("\n") == 1
