"""tformer serve --adapter NAME=RUN: LoRA adapters chosen per request by its `model` field, rows of
different adapters in one decoding batch (model/lora_batched.py). The reference for an adapter is
generate() (or a plain forward pass) of the base with that adapter MERGED into its weights (lora.merge:
W + s B A, a path the batched adapters never take); the adapters are random (B too), so each changes
the text. Also: a seeded sample alone and in a mixed crowd, /v1/models, an unknown model's 404 (and
serving on), a peft adapter directory, an encoder-decoder's adapter, and the refusals at start-up (an
adapter of another base or of an int8 base, a full model, a taken name, a LoRA --model) as one-line CLI
errors."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tformer
import tformer.serve.scheduler as scheduler_module
from serve_util import char_tokenizer, client, httpx, save_tiny, serving
from tformer.checkpoints.hf.lora import to_peft
from tformer.cli import main
from tformer.inference.quant import quantize_int8
from tformer.model import lora_batched
from tformer.model.lora import apply_lora, lora_layers, merge
from tformer.model.lora_batched import StackedLoRALinear, select_adapters, stack_adapters, take_adapters

PROMPTS = ["the quick brown fox", "a", "to be or not to be, that is the question", "once upon a time"]
NAMES = ["base", "alpha", "beta", "gamma"]


def with_adapter(base, seed: int, r: int, alpha: float, targets, rslora: bool = False):
    """The base checkpoint with new adapters, A and B random from `seed` (B is 0 when training starts)."""
    model = tformer.load(base)
    apply_lora(model, r, alpha, targets=targets, rslora=rslora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for adapter in layer.lora.values():
                adapter.a.copy_(torch.randn(adapter.a.shape, generator=g) * 0.3)
                adapter.b.copy_(torch.randn(adapter.b.shape, generator=g) * 0.3)
    return model.eval()


def reference(model, prompt: str, max_tokens: int) -> str:
    tok = char_tokenizer()
    src = torch.tensor([tok.encode(prompt)])
    return tok.decode(model.generate(src, max_new_tokens=max_tokens, eos_token_id=[])[0, src.size(1):])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """base (a GPT-2-shaped tiny decoder), alpha (a run directory: checkpoints/step-*), beta (a checkpoint),
    gamma (a peft directory), and foreign (an adapter of another base); with the merged reference models."""
    d = tmp_path_factory.mktemp("adapters")
    tok = char_tokenizer()
    base = save_tiny(d / "base", "decoder")
    alpha = with_adapter(base, 1, 4, 8, ("q", "v"))
    tformer.save(alpha, d / "alpha-run" / "checkpoints" / "step-0000010", tokenizer=tok, adapter_base=base)
    beta = with_adapter(base, 2, 2, 4, ("k", "o", "up", "down", "lm_head"), rslora=True)
    tformer.save(beta, d / "beta", tokenizer=tok, adapter_base=base)
    gamma = with_adapter(base, 3, 8, 16, ("qkv", "up"))
    to_peft(gamma, d / "gamma-peft")
    int8 = tformer.load(base)
    quantize_int8(int8)
    apply_lora(int8, 4, 8, targets=("q", "v"))
    tformer.save(int8, d / "int8", tokenizer=tok, adapter_base=base)
    other = save_tiny(d / "other", "decoder", seed=5)
    tformer.save(with_adapter(other, 4, 4, 8, ("q", "v")), d / "foreign", tokenizer=tok, adapter_base=other)
    models = {"base": tformer.load(base), "alpha": merge(tformer.load(d / "alpha-run")),   # alpha/beta: read back
              "beta": merge(tformer.load(d / "beta")), "gamma": merge(gamma)}
    specs = [f"alpha={d / 'alpha-run'}", f"beta={d / 'beta'}", f"gamma={d / 'gamma-peft'}"]
    return dict(dir=d, base=base, other=other, models=models, specs=specs)


@pytest.fixture(scope="module")
def server(runs):
    with serving(runs["base"], runs["specs"], max_batch=4, prefill_tokens=8) as (url, app):
        yield url


def concurrently(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


@pytest.mark.parametrize("mixed", ["all run", "gathered"])
def test_stacked_adapters_compute_each_rows_merged_model(mixed, tmp_path, monkeypatch):
    """A batch whose rows use different adapters (and none), through a whole forward pass: each row
    equals its adapter's merged model, both ways a mixed step can go; grouped-query attention's q/k/v
    row ranges, ranks 4 and 2, rsLoRA."""
    monkeypatch.setattr(lora_batched, "DENSE_RANK", 1 << 30 if mixed == "all run" else 0)
    base = save_tiny(tmp_path / "gqa", "decoder", positional="rope", n_kv_heads=2)
    settings = [(1, 4, 8, ("q", "v"), False), (2, 2, 4, ("k", "o", "down", "lm_head"), True)]
    references = [tformer.load(base)] + [merge(with_adapter(base, *s)) for s in settings]
    served = tformer.load(base)
    taken = []
    for s in settings:
        model = with_adapter(base, *s)
        taken.append(take_adapters(model))
        assert not lora_layers(model)                          # taken off: a plain model again
    stack_adapters(served, taken)
    assert isinstance(served.stack.layers[0].attn.qkv_proj, StackedLoRALinear)
    texts = ["abcdefgh", "hello wo", "to be or", "zzyzx ab", "once upo"]
    ids = torch.tensor([char_tokenizer().encode(t) for t in texts])
    rows = [2, 0, 1, 2, 0]
    with torch.inference_mode():
        expected = torch.cat([references[a](ids[i:i + 1]) for i, a in enumerate(rows)])
        select_adapters(served, rows)
        got = served(ids)
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
        for a in range(3):                                     # every row one adapter (a prompt's prefill)
            select_adapters(served, [a] * len(rows))
            assert torch.allclose(served(ids), references[a](ids), atol=1e-4)
        for a in (1, 2):                                       # the adapters matter
            assert (references[a](ids) - references[0](ids)).abs().max() > 0.1
        select_adapters(served, [1, 2])                        # 2 rows named, 5 in the step
        with pytest.raises(RuntimeError, match="2 rows"):
            served(ids)


def test_mixed_adapters_in_one_batch_equal_each_merged_model(runs, server, monkeypatch):
    """Greedy requests for the base and three adapters, concurrently, more than the 4 rows: each returns
    generate()'s tokens on its merged model, and steps ran rows of different adapters together."""
    steps = []
    real = scheduler_module.select_adapters
    monkeypatch.setattr(scheduler_module, "select_adapters", lambda model, rows: (steps.append(list(rows)),
                                                                                  real(model, rows))[1])
    jobs = [(name, p, 10 + 3 * k + j) for k, name in enumerate(NAMES) for j, p in enumerate(PROMPTS)]
    c = client(server)
    got = concurrently(lambda job: c.completions.create(model=job[0], prompt=job[1], max_tokens=job[2],
                                                        temperature=0), jobs)
    for (name, prompt, n), r in zip(jobs, got):
        assert r.choices[0].text == reference(runs["models"][name], prompt, n), (name, prompt)
        assert r.model == name and r.usage.completion_tokens == n
    assert any(len(set(rows)) > 1 for rows in steps)            # rows of different adapters shared a step
    for prompt in PROMPTS[:1]:                                  # and the adapters change the text
        assert len({reference(runs["models"][name], prompt, 20) for name in NAMES}) == len(NAMES)


def test_seeded_sample_is_the_same_alone_and_in_a_mixed_crowd(server):
    c = client(server)

    def ask(job):
        name, temperature = job
        return c.completions.create(model=name, prompt="once upon", max_tokens=24, temperature=temperature,
                                    seed=7).choices[0].text

    alone = ask(("beta", 1.0))
    crowd = concurrently(ask, [("beta", 1.0), ("base", 0), ("alpha", 0), ("gamma", 1.0), ("alpha", 1.0),
                               ("base", 1.0)])
    assert crowd[0] == alone
    assert len({crowd[0], crowd[3], crowd[4], crowd[5]}) > 1    # the same seed, other adapters: other text


def test_models_list_and_unknown_model(runs, server):
    assert [m.id for m in client(server).models.list().data] == NAMES
    data = httpx.get(f"{server}/v1/models").json()["data"]
    assert [m["parent"] for m in data] == [None, "base", "base", "base"]
    r = httpx.post(f"{server}/v1/completions", json={"model": "delta", "prompt": "a", "max_tokens": 2})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "'delta'" in error["message"]
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "to be", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(runs["models"]["base"], "to be", 8)
    r = client(server).completions.create(model="gamma", prompt="to be", max_tokens=8, temperature=0)
    assert r.choices[0].text == reference(runs["models"]["gamma"], "to be", 8)


@pytest.mark.parametrize("case", ["foreign", "full", "taken", "spec", "missing", "int8", "lora-model"])
def test_bad_adapters_are_refused_at_start_up(runs, case, capsys):
    d = runs["dir"]
    spec, words = {"foreign": (f"foreign={d / 'foreign'}", ["trained on another base", str(runs["other"])]),
                   "full": (f"full={runs['other']}", ["is a full model, not a LoRA adapter"]),
                   "taken": (f"base={d / 'beta'}", ["'base' is already taken"]),
                   "spec": (str(d / "beta"), ["write NAME=RUN"]),
                   "missing": (f"x={d / 'nothing'}", ["does not exist"]),
                   "int8": (f"q={d / 'int8'}", ["int8-quantised base"]),
                   "lora-model": (f"x={d / 'beta'}", ["is itself a LoRA adapter", f"--model {runs['base']}"])}[case]
    model = d / "alpha-run" if case == "lora-model" else runs["base"]
    argv = ["serve", "--model", str(model), "--adapter", f"alpha={d / 'alpha-run'}", "--adapter", spec,
            "--port", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --adapter") and err.count("\n") == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err


def test_an_encoder_decoders_adapter_per_request(tmp_path):
    """A translator's adapter (on its encoder, decoder and cross-attention) served beside its base: greedy
    answers for both, concurrently, equal generate() on the source alone, the adapter merged."""
    tok = char_tokenizer()
    base = save_tiny(tmp_path / "s2s", "encoder-decoder")
    adapted = with_adapter(base, 9, 4, 8, ("q", "v", "o"))
    tformer.save(adapted, tmp_path / "s2s-lora", tokenizer=tok, adapter_base=base)
    models = {"s2s": tformer.load(base), "lora": merge(tformer.load(tmp_path / "s2s-lora"))}

    def expected(name, prompt, n):
        src = torch.tensor([tok.encode(prompt) + [tok.eos_id]])
        return tok.decode(models[name].generate(src, max_new_tokens=n, eos_token_id=[])[0, 1:])

    jobs = [(name, p, 9 + k) for k, (name, p) in enumerate((n, p) for n in models for p in PROMPTS)]
    with serving(base, [f"lora={tmp_path / 's2s-lora'}"], max_batch=3) as (url, _):
        c = client(url)
        got = concurrently(lambda job: c.completions.create(model=job[0], prompt=job[1], max_tokens=job[2],
                                                            temperature=0).choices[0].text, jobs)
    assert got == [expected(*job) for job in jobs]
    assert expected("s2s", PROMPTS[0], 20) != expected("lora", PROMPTS[0], 20)


def test_adapters_are_served_in_bf16_with_the_base(runs):
    """`tformer serve --dtype bf16 --adapter ...`: the base and every adapter's tensors in bf16; the base's
    requests get generate()'s tokens of the checkpoint loaded in bf16, the adapters' nearly so: in a crowd the
    stacked adapters' bf16 products group rows otherwise than one request's LoRA layers, and their roundings
    (2^-8) flip the odd near tie of these random adapters, after which a text goes its own way. At least 90%
    of the adapters' tokens come before a row's first difference."""
    with serving(runs["base"], runs["specs"][:2], max_batch=4, prefill_tokens=8, dtype=torch.bfloat16) as (url, app):
        model = app.state.tformer.served.model
        assert {t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()} == {torch.bfloat16}
        c = client(url)
        jobs = [(name, p) for name in ("base", "alpha", "beta") for p in PROMPTS]
        got = concurrently(lambda job: c.completions.create(model=job[0], prompt=job[1], max_tokens=12,
                                                            temperature=0).choices[0].text, jobs)
    d = runs["dir"]
    models = {name: tformer.load(path, dtype=torch.bfloat16)
              for name, path in (("base", runs["base"]), ("alpha", d / "alpha-run"), ("beta", d / "beta"))}
    want = [reference(models[name], p, 12) for name, p in jobs]
    assert got[:len(PROMPTS)] == want[:len(PROMPTS)]                     # the base: exactly
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 12) for x, y in zip(got, want)]
    assert sum(agreed[len(PROMPTS):]) >= 0.9 * 12 * (len(jobs) - len(PROMPTS)), agreed
