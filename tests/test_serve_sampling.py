"""OpenAI's remaining sampling fields on tformer serve, against the formula computed by hand on an
independent forward pass of the same checkpoint: frequency / presence penalties and logit_bias (per
row, rows with different settings in one batch), logit_bias ids out of the vocabulary answer 400
and the server keeps serving, echo + logprobs equal the model's log_softmax over the prompt."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tformer
from serve_util import char_tokenizer, client, httpx, save_tiny, serving
from tformer.generation.processors import apply_frequency_presence, logit_bias_tensor, process_logits
from tformer.serve.sequence import Sequence
from tformer.serve.served import OutputText


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("sampling") / "dec", "decoder", positional="rope")


@pytest.fixture(scope="module")
def server(decoder):
    with serving(decoder, max_batch=4, prefill_tokens=4) as (base, app):   # prompts prefilled in chunks of 4
        yield base, app


@pytest.fixture(scope="module")
def model(decoder):
    return tformer.load(decoder).eval()


def next_logits(model, ids: list[int]) -> torch.Tensor:
    """The next-token logits (V,) by a plain forward pass over the whole sequence (no cache)."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1].double()


def by_hand(model, prompt: list[int], n: int, frequency=0.0, presence=0.0, bias=None) -> list[int]:
    """Greedy with OpenAI's formula: z[t] + bias[t] - frequency * count[t] - presence * (count[t] > 0),
    counts over the generated tokens only."""
    out, counts = [], torch.zeros(model.cfg.vocab_size, dtype=torch.float64)
    for _ in range(n):
        z = next_logits(model, prompt + out)
        for t, b in (bias or {}).items():
            z[t] += b
        z = z - frequency * counts - presence * (counts > 0).double()
        out.append(int(z.argmax()))
        counts[out[-1]] += 1
    return out


def text_of(ids: list[int]) -> str:
    return OutputText(char_tokenizer()).decode(ids)


def test_the_processors_follow_openais_formula():
    torch.manual_seed(0)
    logits, counts = torch.randn(3, 11), torch.randint(0, 4, (3, 11)).float()
    expected = logits - 0.6 * counts - 1.5 * (counts > 0).float()
    assert torch.equal(apply_frequency_presence(logits, counts, 0.6, 1.5), expected)
    per_row = torch.tensor([[0.6], [0.0], [-1.0]])                   # rows with their own penalties
    got = apply_frequency_presence(logits, counts, per_row, 0.0)
    for i in range(3):
        assert torch.equal(got[i], logits[i] - per_row[i, 0] * counts[i])
    bias = logit_bias_tensor({2: 100.0, 7: -100.0}, 11)
    assert bias[0, 2] == 100 and bias[0, 7] == -100 and bias.abs().sum() == 200
    assert (process_logits(logits, logit_bias=bias).argmax(-1) == 2).all()
    assert torch.equal(process_logits(logits), logits)                 # every default: unchanged
    with pytest.raises(ValueError):
        logit_bias_tensor({11: 1.0}, 11)


def test_penalties_and_bias_per_row_in_one_batch_equal_the_formula(model, server, monkeypatch):
    base, app = server
    scheduler, rows = app.state.tformer.scheduler, []
    process = Sequence.process

    def spy(seq, logits):                       # runs on the scheduler thread: how many rows share the step
        rows.append((seq.s.frequency_penalty, seq.s.presence_penalty, len(scheduler.running)))
        return process(seq, logits)

    monkeypatch.setattr(Sequence, "process", spy)
    tok, prompt, n = char_tokenizer(), "the cat sat on the mat", 30
    ids = tok.encode(prompt)
    z_id = tok.encode("z")[0]
    settings = [dict(), dict(frequency_penalty=0.9), dict(presence_penalty=1.7),
                dict(frequency_penalty=0.4, presence_penalty=-0.5, logit_bias={str(z_id): 3.5})]
    c = client(base)
    with ThreadPoolExecutor(len(settings)) as pool:
        got = list(pool.map(lambda s: c.completions.create(model="dec", prompt=prompt, max_tokens=n, temperature=0,
                                                           extra_body=s).choices[0].text, settings))
    expected = [text_of(by_hand(model, ids, n, s.get("frequency_penalty", 0.0), s.get("presence_penalty", 0.0),
                                {int(k): v for k, v in s.get("logit_bias", {}).items()})) for s in settings]
    assert got == expected
    assert len(set(expected)) == len(settings)                 # each setting changes the text
    assert max(r[2] for r in rows) >= 2                         # rows with different settings stepped together


def test_sampled_steps_use_the_penalised_logits(model, server, monkeypatch):
    """At every sampled step, the logits the server samples from equal the formula applied to an
    independent forward pass, with the counts of the tokens generated before that step."""
    base, _ = server
    seen = []
    process = Sequence.process

    def spy(seq, logits):
        out = process(seq, logits)
        seen.append((list(seq.prompt), list(seq.generated), out[0].double().clone()))
        return out

    monkeypatch.setattr(Sequence, "process", spy)
    f, p, t, bias = 1.2, 0.8, 0.7, {5: -2.0, 9: 1.5}
    n = model.cfg.vocab_size + 3              # more tokens than the vocabulary: some repeat, counts above 1
    r = client(base).completions.create(model="dec", prompt="once upon a time", max_tokens=n, temperature=t,
                                        seed=3, extra_body=dict(frequency_penalty=f, presence_penalty=p,
                                                                logit_bias={str(k): v for k, v in bias.items()}))
    assert r.usage.completion_tokens == n and len(seen) == n
    for prompt, generated, processed in seen:
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=model.cfg.vocab_size).double()
        z = next_logits(model, prompt + generated)
        for k, b in bias.items():
            z[k] += b
        expected = (z - f * counts - p * (counts > 0).double()) / t
        torch.testing.assert_close(processed, expected, atol=1e-4, rtol=1e-5)


def test_logit_bias_forces_and_bans_tokens(model, server):
    base, _ = server
    tok, c = char_tokenizer(), client(base)
    z = tok.encode("z")[0]
    forced = c.completions.create(model="dec", prompt="hello", max_tokens=10, temperature=1.0, seed=1,
                                  logit_bias={str(z): 100})
    assert forced.choices[0].text == "z" * 10
    first = by_hand(model, tok.encode("hello"), 1)[0]
    banned = c.completions.create(model="dec", prompt="hello", max_tokens=20, temperature=0,
                                  logit_bias={str(first): -100}).choices[0].text
    assert tok.decode([first]) not in banned
    assert banned == text_of(by_hand(model, tok.encode("hello"), 20, bias={first: -100}))


def test_bad_logit_bias_answers_400_and_the_server_keeps_serving(server):
    base, app = server
    url, vocab = f"{base}/v1/completions", app.state.tformer.served.model.cfg.vocab_size
    for bias, named in [({str(vocab): 1}, str(vocab)), ({"100000": -5, "1": 2}, "100000"), ({"abc": 1}, "abc"),
                        ({"-3": 1}, "-3"), ({"3": 250}, "250")]:
        r = httpx.post(url, json={"model": "dec", "prompt": "a", "logit_bias": bias})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "logit_bias" and named in error["message"] and error["type"] == "invalid_request_error"
    chat = httpx.post(f"{base}/v1/chat/completions", json={"model": "dec", "messages": [{"role": "user",
                                                                                           "content": "hi"}],
                                                           "logit_bias": {"99999": 1}})
    assert chat.status_code == 400
    r = httpx.post(url, json={"model": "dec", "prompt": "a", "presence_penalty": 2.5})
    assert r.status_code == 422 and r.json()["error"]["param"] == "presence_penalty"
    ok = httpx.post(url, json={"model": "dec", "prompt": "a", "max_tokens": 3, "logit_bias": {"3": 1}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def log_softmax_by_hand(model, ids: list[int]) -> torch.Tensor:
    """log p(next token | ids[:j + 1]) at every position j, by one forward pass: (T, V)."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].double().log_softmax(-1)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_gives_the_prompts_logprobs(model, server, stream):
    base, _ = server
    tok, prompts, n = char_tokenizer(), ["to be or not to be", "a"], 5
    ask = dict(model="dec", prompt=prompts, max_tokens=n, temperature=0, echo=True, logprobs=2)
    if stream:
        chunks = [ch for ch in client(base).completions.create(**ask, stream=True) if ch.choices]
        choices = []
        for i in range(len(prompts)):
            mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == i]
            lps = [ch.logprobs for ch in mine if ch.logprobs]
            choices.append(dict(text="".join(ch.text for ch in mine),
                                tokens=sum((lp.tokens for lp in lps), []),
                                token_logprobs=sum((lp.token_logprobs for lp in lps), []),
                                top_logprobs=sum((lp.top_logprobs for lp in lps), []),
                                text_offset=sum((lp.text_offset for lp in lps), [])))
    else:
        r = client(base).completions.create(**ask)
        choices = [dict(text=c.text, **c.logprobs.model_dump()) for c in r.choices]
    for prompt, got in zip(prompts, choices):
        ids = tok.encode(prompt)
        generated = by_hand(model, ids, n)
        assert got["text"] == prompt + text_of(generated)
        assert got["tokens"] == [tok.decode([i]) for i in ids + generated]
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None        # nothing predicts it
        whole = ids + generated
        logp = log_softmax_by_hand(model, whole)                                          # (T, V)
        expected = logp[torch.arange(len(whole) - 1), torch.tensor(whole[1:])]          # token j given those before
        assert got["token_logprobs"][1:] == pytest.approx(expected.tolist(), abs=1e-4)
        for j, top in enumerate(got["top_logprobs"][1:]):
            best = logp[j].topk(2)
            assert top == pytest.approx({tok.decode([int(i)]): float(v) for v, i in zip(best.values, best.indices)},
                                        abs=1e-4)
        assert got["text_offset"] == [sum(len(t) for t in got["tokens"][:k]) for k in range(len(got["tokens"]))]
