"""Structured outputs on tformer serve (xgrammar): response_format json_object / json_schema on both
generating endpoints, tool calls (tool_choice required / named / auto / none), bad schemas.

The model has random weights (its unconstrained text is garbage), so every answer that parses owes it
to the grammar. Checked against independent references: json.loads and the `jsonschema` validator,
the bit layout by hand, the same request alone (greedy and seeded answers do not depend on the crowd),
and the official `openai` client."""

import json
import string
from concurrent.futures import ThreadPoolExecutor

import jinja2
import pytest
import torch

from serve_util import client, httpx, save_tiny, serving
from tformer.data.tokenizers import Tokenizer
from tformer.generation.processors import apply_token_mask, unpack_bitmask
from tformer.serve.schemas import ChatRequest
from tformer.serve.sequence import Sequence
from tformer.serve.structured import Tools

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

# printable ASCII: JSON's characters are tokens (tab and newline too, which compact JSON never uses)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if tools %}functions: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}"
            "assistant: ")


def obj(properties: dict, required=None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


def text(max_length: int, min_length: int = 0) -> dict:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


# bounded (a random model never closes a free string or stops a free number by itself)
SCHEMAS = [
    obj({"name": text(12), "age": integer(0, 120)}),
    obj({"status": {"enum": ["open", "closed", "pending"]}, "priority": integer(1, 5)}),
    obj({"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}}),
    obj({"user": obj({"id": integer(1, 999), "name": text(8)}), "active": {"type": "boolean"}}),
    obj({"items": {"type": "array", "items": obj({"sku": text(6, 1), "qty": integer(1, 9)}), "maxItems": 3}}),
    obj({"title": text(10), "note": text(10)}, required=["title"]),
    obj({"code": {"enum": ["A1", "B2", None]}, "count": integer(0, 50)}),
    obj({"a": obj({"b": obj({"c": {"enum": ["x", "y"]}})})}),
    obj({"word": text(5, 2), "letters": {"type": "array", "items": text(1, 1), "maxItems": 5}}),
    obj({"kind": {"const": "point"},
         "coords": {"type": "array", "items": integer(-9, 9), "minItems": 2, "maxItems": 3}}),
]
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "the forecast", "parameters": obj(
        {"city": text(10, 1), "days": integer(1, 7), "unit": {"enum": ["c", "f"]}})}},
    {"type": "function", "function": {"name": "lookup", "parameters": obj({"query": text(12, 1)})}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("structured") / "json", "decoder", positional="rope", max_seq_len=384,
                     tokenizer=Tokenizer.char(string.printable))
    (path / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(model_dir, max_batch=16) as (base, app):
        yield base, app


def request(k: int, schema: dict | None, sampled: bool, chat: bool) -> tuple[str, dict]:
    """Request k: a json_schema (or plain, schema None) answer, greedy or seeded, on either endpoint."""
    body = {"model": "json", "max_tokens": 200, "temperature": 1.0 if sampled else 0, "seed": k}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": f"s{k}", "schema": schema, "strict": True}}
    if chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"request {k}, please"}]}
    return "/v1/completions", {**body, "prompt": f"request {k}: "}


def answer(r: httpx.Response) -> tuple[str, str]:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"], choice["finish_reason"]


def test_the_bitmask_and_the_mask_against_the_layout_by_hand():
    torch.manual_seed(0)
    vocab = 70                                                  # 3 words of 32 bits, the last one partly used
    words = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32)
    by_hand = torch.tensor([[(int(w[t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] for w in words])
    assert torch.equal(unpack_bitmask(words, vocab), by_hand)
    logits = torch.randn(2, vocab)
    masked = apply_token_mask(logits, by_hand)
    assert torch.equal(masked[by_hand], logits[by_hand]) and (masked[~by_hand] == float("-inf")).all()


def test_tool_choice_rules_and_reading_a_call():
    def tools(choice, template="{{ tools }}", given=TOOLS):
        body = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                           "tools": given, "tool_choice": choice})
        return Tools(body, template)

    assert tools(None).choice == "auto" and tools(None, given=None).choice == "none"
    assert tools("auto", template="no mention of them").choice == "none"    # a template that never shows tools
    named = tools({"type": "function", "function": {"name": "lookup"}})
    assert named.forced and named.schema()["properties"]["name"] == {"const": "lookup"}
    assert [s["properties"]["name"]["const"] for s in tools("required").schema()["anyOf"]] == ["weather", "lookup"]
    auto = tools("auto")
    call = auto.calls('{"name": "lookup", "parameters": {"query": "q"}}')       # Llama 3.1's key
    assert call[0]["function"] == {"name": "lookup", "arguments": '{"query": "q"}'} and call[0]["type"] == "function"
    assert auto.calls('{"name": "other", "arguments": {}}') is None and auto.calls("lookup(q)") is None
    assert auto.may_be_call(' {"na') and not auto.may_be_call("Hello")


def test_200_answers_over_10_schemas_parse_and_validate_in_a_crowd(server, monkeypatch):
    base, app = server
    scheduler, steps = app.state.tformer.scheduler, []
    choose = Sequence.choose

    def spy(seq, logits):            # on the scheduler thread: which rows (grammar or not) share the step
        steps.append((len(scheduler.running), sum(r.matcher is not None for r in scheduler.running)))
        return choose(seq, logits)

    monkeypatch.setattr(Sequence, "choose", spy)
    jobs = [(k, SCHEMAS[k % 10], k % 20 >= 10, k % 3 != 0) for k in range(200)]       # greedy / sampled, both routes
    plain = [(1000 + k, None, k % 2 == 1, True) for k in range(10)]                    # no grammar, same batches
    with ThreadPoolExecutor(24) as pool:
        got = list(pool.map(lambda j: answer(httpx.post(base + (r := request(*j))[0], json=r[1], timeout=600)),
                            jobs + plain))
    for (k, schema, sampled, chat), (text, reason) in zip(jobs, got):
        assert reason == "stop", (k, text)
        jsonschema.validate(json.loads(text), schema)
    assert max(n for n, _ in steps) >= 8 and any(0 < g < n for n, g in steps)         # mixed batches
    # the same answer alone: greedy tokens and seeded samples do not depend on the crowd
    again = [j for j in jobs if j[0] % 10 == j[0] // 10 % 10] + plain[:4]
    for job in again:
        r = request(*job)
        assert answer(httpx.post(base + r[0], json=r[1], timeout=120)) == got[(jobs + plain).index(job)], job
    unconstrained = [t for t, _ in got[200:]]
    assert sum(1 for t in unconstrained if t.startswith("{")) <= 1       # the model alone writes no JSON


def test_json_object_mode_parses_on_both_routes(server):
    base, _ = server

    def ask(k):
        route, body = request(k, None, sampled=True, chat=k % 2 == 0)
        body.update(response_format={"type": "json_object"}, max_tokens=300)
        return answer(httpx.post(base + route, json=body, timeout=600))

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(16)))
    finished = [json.loads(t) for t, reason in got if reason == "stop"]
    # strings are free in json_object mode: a random model may write one past max_tokens ("length")
    assert len(finished) >= 8 and all(isinstance(x, dict) for x in finished)
    assert all(t.startswith("{") for t, _ in got)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_required_and_named(server, stream):
    base, _ = server
    for choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
        body = {"model": "json", "messages": [{"role": "user", "content": "what now?"}], "tools": TOOLS,
                "tool_choice": choice, "max_tokens": 120, "temperature": 0, "stream": stream}
        if not stream:
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            choice_ = r.json()["choices"][0]
            message, reason = choice_["message"], choice_["finish_reason"]
            assert message["content"] is None
            calls = message["tool_calls"]
        else:
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            deltas = [c["choices"][0]["delta"] for c in chunks]
            assert deltas[0]["role"] == "assistant" and not any(d.get("content") for d in deltas)
            calls = [c for d in deltas for c in d.get("tool_calls", [])]
            reason = chunks[-1]["choices"][0]["finish_reason"]
        assert reason == "tool_calls" and len(calls) == 1
        call = calls[0]
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        assert name == (choice["function"]["name"] if isinstance(choice, dict) else name) and name in PARAMETERS
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[name])


def test_a_function_without_parameters_is_called_with_no_arguments(server):
    base, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": "json", "messages": [{"role": "user", "content": "now"}], "n": 2, "temperature": 1, "seed": 3,
        "tools": [{"type": "function", "function": {"name": "now"}}], "tool_choice": "required"})
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {}


def test_tools_reach_the_template_unless_none(server):
    base, _ = server
    usage = {}
    for choice in ("none", "auto"):
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": "json", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": choice,
            "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        usage[choice] = r.json()["usage"]["prompt_tokens"]
    # the template rendered as transformers renders it, with the tools and without
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    rendered = {c: env.from_string(TEMPLATE).render(messages=[{"role": "user", "content": "hi"}],
                                                    tools=TOOLS if c == "auto" else None) for c in usage}
    assert usage["auto"] - usage["none"] == len(rendered["auto"]) - len(rendered["none"]) > 10


def test_bad_schemas_and_tool_choices_answer_400_and_the_server_keeps_serving(server):
    base, _ = server
    messages = [{"role": "user", "content": "hi"}]
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
            "response_format", "frob"),
           ({"response_format": {"type": "json_schema", "json_schema": {
               "name": "x", "schema": {"type": "string", "pattern": "(("}}}}, "response_format", "parenthesis"),
           ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
             "tool_choice": "required"}, "tools", "frob"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
           ({"tool_choice": "required"}, "tool_choice", "needs tools"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": []}}}},
            "response_format", "admits no value")]
    for extra, param, word in bad:
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": "json", "messages": messages, **extra})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and word in error["message"], r.text
        assert "\n" not in error["message"] and ".cc" not in error["message"]
    r = httpx.post(f"{base}/v1/completions", json={"model": "json", "prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}})
    assert r.status_code == 400
    route, body = request(7, SCHEMAS[0], sampled=False, chat=True)
    text, reason = answer(httpx.post(base + route, json=body, timeout=120))
    jsonschema.validate(json.loads(text), SCHEMAS[0])
    assert httpx.get(f"{base}/health").status_code == 200


def test_the_openai_client_gets_a_json_schema_answer_and_a_tool_call(server):
    base, _ = server
    api = client(base)
    schema = SCHEMAS[3]
    r = api.chat.completions.create(model="json", messages=[{"role": "user", "content": "a user, please"}],
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "user", "schema": schema, "strict": True}},
                                    temperature=0, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = api.chat.completions.create(model="json", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "weather"}},
                                    temperature=0, max_tokens=120)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["weather"])
