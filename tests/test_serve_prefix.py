"""The server's KV memory: the prefix cache (blocks of prefilled prompts copied into later prompts
with the same start), chunked prefill, and a pool that grows and shrinks with the rows it holds.
References: model.generate on each prompt alone (a separately loaded model), the keys of an uncached
prefill, the LRU rule and the pool's size computed from shapes by hand."""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tformer
from serve_util import char_tokenizer, client, httpx, save_tiny, serving
from tformer.serve.pool import BLOCK, SHRINK_AFTER, SlotPool  # noqa: E402  (after serve_util's importorskip)
from tformer.serve.prefix import TOKENS, PrefixCache  # noqa: E402

SHARED = "once upon a time, in a land far away, there lived a fox who liked long stories. "   # 82 chars
TAILS = ["the end", "and then?", "a", "who knows what happened next, nobody", "zz", "it rained"]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("prefix") / "dec", "decoder", positional="rope", n_kv_heads=2,
                     max_seq_len=256)


def reference(path, prompt: str, max_tokens: int) -> str:
    model, tok = tformer.load(path), char_tokenizer()
    src = torch.tensor([tok.encode(prompt)])
    return tok.decode(model.generate(src, max_new_tokens=max_tokens, eos_token_id=[])[0, src.size(1):])


def metric(base: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{base}/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def shared_blocks(a: list[int], b: list[int]) -> int:
    """Whole 16-token blocks at the start of b that a prompt a stored before it has too (by hand)."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(same, len(a)) // TOKENS


def test_a_prefix_hit_gives_generates_tokens_and_is_counted(decoder):
    tok = char_tokenizer()
    first, second = SHARED + TAILS[0], SHARED + TAILS[1]
    with serving(decoder, max_batch=3, prefill_tokens=8) as (base, app):
        c = client(base)
        got = [c.completions.create(model="dec", prompt=p, max_tokens=20, temperature=0).choices[0].text
               for p in (first, second)]
        a, b = tok.encode(first), tok.encode(second)
        assert metric(base, "tformer_prefix_cache_queries_total") == len(a) + len(b)
        assert metric(base, "tformer_prefix_cache_hits_total") == shared_blocks(a, b) * TOKENS == 80
        held = httpx.get(f"{base}/metrics").text
        assert re.search(r'^tformer_kv_cache_bytes\{part="prefix"\} [1-9]', held, re.M)
        assert re.search(r'^tformer_kv_cache_bytes\{part="running"\} 0\.0$', held, re.M)   # no row: nothing held
    assert got == [reference(decoder, first, 20), reference(decoder, second, 20)]


def test_a_reply_is_cached_for_the_next_turn(decoder):
    tok = char_tokenizer()
    first = SHARED + TAILS[3]
    with serving(decoder, max_batch=2, prefill_tokens=8) as (base, _):
        c = client(base)
        no_specials = {str(i): -100 for i in tok.special_ids}       # the text then re-encodes to the same ids
        reply = c.completions.create(model="dec", prompt=first, max_tokens=40, temperature=0,
                                     logit_bias=no_specials).choices[0].text
        before = metric(base, "tformer_prefix_cache_hits_total")
        second = first + reply + " and then"                       # the next turn quotes the reply
        got = c.completions.create(model="dec", prompt=second, max_tokens=10, temperature=0).choices[0].text
        hits = metric(base, "tformer_prefix_cache_hits_total") - before
    prompt, generated = tok.encode(first), tok.encode(reply)
    held = (prompt + generated)[:len(prompt) + len(generated) - 1]  # the reply's last token was never fed
    assert hits == shared_blocks(held, tok.encode(second)) * TOKENS > len(prompt) // TOKENS * TOKENS
    assert got == reference(decoder, second, 10)


def test_a_crowd_with_prefix_hits_and_chunked_prefill_equals_generate_alone(decoder):
    prompts = [SHARED + t for t in TAILS] + [SHARED[:40] + t for t in TAILS[:3]] + [SHARED * 2]
    lengths = [12, 30, 7, 25, 18, 9, 14, 5, 21, 16]
    with serving(decoder, max_batch=3, prefill_tokens=5) as (base, _):     # fewer rows than requests
        c = client(base)
        c.completions.create(model="dec", prompt=SHARED, max_tokens=1, temperature=0)       # stores the prefix
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda i: c.completions.create(model="dec", prompt=prompts[i], max_tokens=lengths[i],
                                                               temperature=0).choices[0].text, range(len(prompts))))
        assert metric(base, "tformer_prefix_cache_hits_total") >= len(prompts) * 32    # every one hit >= 2 blocks
        ask = dict(model="dec", prompt=SHARED + "and", max_tokens=25, temperature=1.0, top_p=0.9, seed=77)
        alone = c.completions.create(**ask).choices[0].text
        with ThreadPoolExecutor(6) as pool:
            crowd = list(pool.map(lambda i: c.completions.create(**{**ask, "seed": 77 if i % 2 else i}).choices[0].text,
                                  range(6)))
    assert got == [reference(decoder, p, n) for p, n in zip(prompts, lengths)]
    assert crowd[1] == crowd[3] == crowd[5] == alone                  # a seeded sample: the same whatever runs
    assert len({alone, crowd[0], crowd[2], crowd[4]}) > 1


def test_eviction_under_a_tiny_bound_keeps_the_answers_right(decoder):
    cfg = tformer.load(decoder).cfg
    block = 2 * cfg.n_layers * 2 * TOKENS * (cfg.d_model // cfg.n_heads) * 4        # K and V, 2 kv heads, fp32
    a, b = SHARED + "abc", "zz" + SHARED[:30]                 # 5 and 2 whole blocks
    # room for 4 blocks, least recently used out, a chain's end before its start (by hand):
    #   a: stores a0..a3 | b: b0, b1 evict a3, a2 | a again: hits a0, a1 (32), stores a2, a3 evicting b1, b0
    #   b again: misses, its b0, b1 evict a3, a2 | SHARED: hits a0, a1 (32)
    prompts = [a, b, SHARED + "abd", b + "x", SHARED]
    with serving(decoder, max_batch=2, prefill_tokens=16, prefix_cache_mb=4 * block / 2**20) as (base, app):
        c = client(base)
        got = []
        for p in prompts:
            got.append(c.completions.create(model="dec", prompt=p, max_tokens=10, temperature=0).choices[0].text)
            assert app.state.tformer.scheduler.prefix.nbytes <= 4 * block
        assert metric(base, "tformer_prefix_cache_hits_total") == 64
    assert got == [reference(decoder, p, 10) for p in prompts]


def test_encoder_decoders_serve_without_a_prefix_cache(tmp_path):
    path = save_tiny(tmp_path / "s2s", "encoder-decoder")
    with serving(path, max_batch=2, prefill_tokens=4) as (base, app):
        r = client(base).completions.create(model="s2s", prompt=SHARED[:40], max_tokens=8, temperature=0)
        assert app.state.tformer.scheduler.prefix is None
    model, tok = tformer.load(path), char_tokenizer()
    src = torch.tensor([tok.encode(SHARED[:40]) + [tok.eos_id]])
    assert r.choices[0].text == tok.decode(model.generate(src, max_new_tokens=8, eos_token_id=[])[0, 1:])


def prefilled(model, ids: list[int], room: int = 0):
    cache = model.new_cache(1, len(ids) + room)
    with torch.no_grad():
        model.step(torch.tensor([ids]), cache)
    return cache


def test_restore_copies_the_stored_keys_and_lru_evicts_chain_ends_first(decoder):
    model = tformer.load(decoder)
    ids = lambda text: char_tokenizer().encode(text)                              # noqa: E731
    a, b = ids(SHARED[:60]), ids("zz" + SHARED[:40])        # 3 and 2 full blocks (+ a partial one)
    one = 2 * model.cfg.n_layers * 2 * TOKENS * 8 * 4
    store = PrefixCache(3 * one)
    ka, kb = store.keys(a), store.keys(b)
    assert store.keys(a, salt="1") != ka and store.keys(a[:40]) == ka[:2]        # another adapter: other keys
    full = prefilled(model, a)
    store.store(ka, full, len(a))
    fresh = model.new_cache(1, len(a))
    assert store.restore(a, ka, fresh) == 48
    for mine, theirs in zip(fresh.layers, full.layers):
        assert torch.equal(mine.k[0, :, :48], theirs.k[0, :, :48])
        assert torch.equal(mine.v[0, :, :48], theirs.v[0, :, :48])
    store.store(kb, prefilled(model, b), len(b))             # room for 3: a's last two blocks go, a's first stays
    assert store.nbytes == 3 * one
    assert store.restore(a, ka, model.new_cache(1, len(a))) == 16
    assert store.restore(b, kb, model.new_cache(1, len(b))) == 32
    short = b[:32]                                           # two whole stored blocks: its last token is computed
    assert store.restore(short, store.keys(short), model.new_cache(1, len(short))) == 31


def test_the_pool_grows_and_shrinks_with_the_rows(decoder):
    model = tformer.load(decoder)
    cfg = model.cfg
    per_position = 2 * cfg.n_layers * 2 * (cfg.d_model // cfg.n_heads) * 4     # K and V of one row, fp32
    pool = SlotPool(model, max_batch=8, max_len=cfg.max_seq_len)
    assert pool.nbytes() == 0

    def check(n: int) -> None:
        k = pool.layers[0].k
        assert pool.nbytes() == k.size(0) * k.size(2) * per_position          # every layer's K, V: this shape
        longest = max(pool.lengths[:n]) + 1
        assert n <= k.size(0) < 2 * n and longest <= k.size(2) <= min(longest * 5 // 4 + BLOCK, cfg.max_seq_len)

    lengths = [10, 70, 30, 5, 100]
    for slot, t in enumerate(lengths):
        pool.admit(slot, prefilled(model, [3 + i % 20 for i in range(t)]))
        check(slot + 1)
    for _ in range(60):                                      # the longest row reaches the end: the pool grows
        pool.view(5)
        pool.advance(5)
    check(5)
    assert pool.lengths[:5] == [70, 130, 90, 65, 160]
    row0, row3 = pool.layers[0].k[0, :, :70].clone(), pool.layers[0].v[3, :, :65].clone()
    pool.free(4)                                              # the scheduler's _remove of rows 4, 1, 2:
    pool.move(3, 1)                                           # the last row fills the gap
    pool.free(2)
    for step in range(SHRINK_AFTER):                          # rows [70, 65] left: 2 x 128 positions, not 8 x 256,
        assert pool.layers[0].k.size(0) == 8                  # once it has been twice too large for a while
        pool.trim(2)
    check(2)
    assert pool.nbytes() == 2 * 128 * per_position
    assert torch.equal(pool.layers[0].k[0, :, :70], row0) and torch.equal(pool.layers[0].v[1, :, :65], row3)
    pool.free(0), pool.free(1)
    pool.trim(0)
    assert pool.nbytes() == 0


@pytest.mark.parametrize("path", ["kernel", "sdpa"])
def test_a_step_over_the_pool_equals_each_row_alone_whatever_free_slots_hold(decoder, path, monkeypatch):
    if path == "sdpa":                  # as on a GPU: PyTorch's attention reads masked keys too
        monkeypatch.setattr(tformer.model.attention, "decoding_attention", lambda *a, **k: None)
    model = tformer.load(decoder)
    prompts = [[3 + (i * 7 + j) % 30 for j in range(n)] for i, n in enumerate((12, 40, 7))]
    pool = SlotPool(model, max_batch=4, max_len=model.cfg.max_seq_len)
    for slot, p in enumerate(prompts[:2]):
        pool.admit(slot, prefilled(model, p))
    for layer in pool.layers:                                 # a free slot's memory: anything, NaN included
        layer.k[2:], layer.v[2:] = float("nan"), float("nan")
    pool.admit(2, prefilled(model, prompts[2]))
    ids = torch.tensor([[5], [9], [11]])
    with torch.no_grad():
        got = model.step(ids, pool.view(3), pool.mask(3), pool.positions(3))                      # (3, V)
        for i, p in enumerate(prompts):
            alone = model.step(ids[i:i + 1], prefilled(model, p, room=1))                                  # (1, V)
            torch.testing.assert_close(got[i], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["kernel", "sdpa"])
def test_a_bf16_pool_holds_half_and_steps_as_its_keys_widened_to_fp32(decoder, path, monkeypatch):
    """--kv-cache-dtype bf16: the same step as an fp32 pool holding the very same (rounded) keys and values,
    through the decoding kernel (which widens them as it reads) and through PyTorch's attention (which gets
    them converted); half the bytes."""
    if path == "sdpa":
        monkeypatch.setattr(tformer.model.attention, "decoding_attention", lambda *a, **k: None)
    model = tformer.load(decoder)
    prompts = [[3 + (i * 5 + j) % 30 for j in range(n)] for i, n in enumerate((20, 9, 33))]
    half, full = (SlotPool(model, max_batch=4, max_len=model.cfg.max_seq_len, kv_dtype=d)
                  for d in (torch.bfloat16, None))
    for slot, p in enumerate(prompts):
        half.admit(slot, prefilled(model, p))
        full.admit(slot, prefilled(model, p))
    assert half.layers[0].k.dtype == torch.bfloat16 and half.nbytes() * 2 == full.nbytes()
    for a, b in zip(half.layers, full.layers):                # the fp32 pool gets the bf16 pool's values,
        b.k.copy_(a.k.float()), b.v.copy_(a.v.float())        # and the step's new ones rounded as they are there
        b.update = lambda k, v, store=b.update: store(k.bfloat16().float(), v.bfloat16().float())
    ids = torch.tensor([[5], [9], [11]])
    with torch.no_grad():
        got, widened = (model.step(ids, p.view(3), p.mask(3), p.positions(3)) for p in (half, full))
    torch.testing.assert_close(got, widened, rtol=1e-5, atol=1e-5)
    assert torch.equal(half.layers[1].k[:3, :, 20:21].float(), full.layers[1].k[:3, :, 20:21])   # the new keys too


def test_a_server_with_a_bf16_kv_cache_answers_as_the_fp32_one_within_its_rounding(decoder):
    asks = [dict(prompt=SHARED[:20 + 9 * i] + tail, max_tokens=24, temperature=0, logprobs=1)
            for i, tail in enumerate(TAILS)]
    answers = []
    for dtype in ("auto", "bf16"):
        with serving(decoder, max_batch=4, prefill_tokens=16, kv_cache_dtype=dtype) as (base, _):
            c = client(base)
            with ThreadPoolExecutor(len(asks)) as pool:
                answers.append(list(pool.map(lambda ask: c.completions.create(model="dec", **ask).choices[0], asks)))
    same = sum(a == b for fp32, bf16 in zip(*answers) for a, b in zip(fp32.text, bf16.text))
    assert same >= 0.9 * sum(len(fp32.text) for fp32 in answers[0])        # greedy: nearly every token the same
    first = [(fp32.logprobs.token_logprobs[0], bf16.logprobs.token_logprobs[0]) for fp32, bf16 in zip(*answers)]
    assert all(abs(a - b) < 0.05 for a, b in first)                       # the prompt's own keys, rounded
