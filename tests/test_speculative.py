"""Speculative decoding: greedy gives plain greedy's tokens (a draft that is often wrong, one that is
always right, prompt lookup), the caches are cut back to the accepted tokens, the sampling rule keeps
the model's processed distribution (exactly, enumerated over a small vocabulary; and empirically,
through generate), bad arguments are one ConfigError each, and `tformer generate`'s flags."""

import itertools

import pytest
import torch
from scipy.stats import chi2

import tformer
from tformer import Decoder, EncoderDecoder, ModelConfig
from tformer.cli import main
from tformer.data.tokenizers import Tokenizer
from tformer.errors import ConfigError
from tformer.generation import SpeculativeStats, process_logits, stream
from tformer.generation.prepare import prepare
from tformer.generation.settings import make_settings
from tformer.generation.speculative import acceptance, make_speculation, residual, speculative_steps

GPT = dict()                                                              # learned positions, LayerNorm, GELU
LLAMA = dict(positional="rope", norm="rmsnorm", activation="swiglu", bias=False)


def build(seed=0, vocab=29, **kw):
    cfg = dict(kind="decoder", vocab_size=vocab, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=128,
               tie_embeddings=False)
    torch.manual_seed(seed)
    model = Decoder(ModelConfig(**{**cfg, **kw}))
    with torch.no_grad():                   # spread the logits: greedy choices are clear-cut, text varies
        model.lm_head.weight.mul_(20)
    return model.eval()


def rand_ids(n, seed=0, vocab=29):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# --- greedy: plain greedy's tokens --------------------------------------------------------------------

@pytest.mark.parametrize("shape", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_with_a_draft_model_gives_plain_greedy_tokens(shape, k):
    model, other = build(0, **shape), build(1, n_layers=1, **shape)
    ids = rand_ids(7)
    plain = model.generate(ids, max_new_tokens=60, eos_token_id=[])
    wrong, right = SpeculativeStats(), SpeculativeStats()
    assert torch.equal(model.generate(ids, max_new_tokens=60, eos_token_id=[], draft_model=other,
                                      num_draft_tokens=k, speculative_stats=wrong), plain)
    assert torch.equal(model.generate(ids, max_new_tokens=60, eos_token_id=[], draft_model=model,
                                      num_draft_tokens=k, speculative_stats=right), plain)
    assert wrong.proposed > 0 and wrong.accepted < wrong.proposed / 2           # mostly rejected
    assert right.accepted == right.proposed > 0                                 # the model drafting for itself
    assert right.rounds == -(-60 // (k + 1))                                    # k + 1 tokens per model step


def test_greedy_with_a_repetition_penalty_and_eos_gives_plain_greedy_tokens():
    model, other = build(0), build(2, n_layers=1)
    ids = rand_ids(5, seed=3)
    plain = model.generate(ids, max_new_tokens=50, eos_token_id=[], repetition_penalty=1.5)
    eos = int(plain[0, 5 + 30])                          # a token the text reaches: generation stops there
    first = 5 + plain[0, 5:].tolist().index(eos)
    stopped = model.generate(ids, max_new_tokens=50, eos_token_id=eos, repetition_penalty=1.5)
    assert stopped.size(1) == first + 1
    for draft in (dict(draft_model=other), dict(prompt_lookup=1)):
        assert torch.equal(model.generate(ids, max_new_tokens=50, eos_token_id=[], repetition_penalty=1.5,
                                          num_draft_tokens=4, **draft), plain)
        assert torch.equal(model.generate(ids, max_new_tokens=50, eos_token_id=eos, repetition_penalty=1.5, **draft),
                           stopped)


def test_prompt_lookup_on_a_repetitive_prompt_gives_plain_greedy_tokens():
    """The prompt is the model's own greedy text, twice: its continuation repeats n-grams of the prompt."""
    model = build(4)
    text = model.generate(rand_ids(4, seed=1), max_new_tokens=40, eos_token_id=[])
    ids = torch.cat([text, text], dim=1)
    plain = model.generate(ids, max_new_tokens=40, eos_token_id=[])
    for ngram in (1, 2, 3):
        stats = SpeculativeStats()
        out = model.generate(ids, max_new_tokens=40, eos_token_id=[], prompt_lookup=ngram, num_draft_tokens=5,
                             speculative_stats=stats)
        assert torch.equal(out, plain)
        assert stats.accepted > 0 and stats.rounds < 40


def test_streamed_tokens_are_the_generated_ones():
    model, other = build(0), build(1, n_layers=1)
    ids = rand_ids(6)
    plain = model.generate(ids, max_new_tokens=30, eos_token_id=[])
    steps = list(stream(model, ids, max_new_tokens=30, eos_token_id=[], draft_model=other, num_draft_tokens=3))
    assert all(s.shape == (1,) for s in steps)
    assert torch.equal(torch.cat(steps), plain[0, 6:])


# --- the KV cache --------------------------------------------------------------------------------------

def test_a_truncated_cache_continues_as_if_the_cut_positions_were_never_fed():
    model = build(0)
    ids, other = rand_ids(12), rand_ids(4, seed=9)
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        model.step(ids, cache)
        cache.truncate(8)
        cached = model.step(other, cache, all_logits=True)
        whole = model(torch.cat([ids[:, :8], other], dim=1))[:, 8:]
    torch.testing.assert_close(cached, whole, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(cache.length + 1)


def test_after_speculative_decoding_both_caches_hold_exactly_the_accepted_tokens():
    model, other = build(0, **LLAMA), build(1, n_layers=1, **LLAMA)
    ids = rand_ids(5)
    s = make_settings(model, max_new_tokens=25, eos_token_id=[])
    spec = make_speculation(model, s, ids, None, draft_model=other, num_draft_tokens=4)
    with torch.inference_mode():
        p = prepare(model, ids, None, s, 1)
        list(speculative_steps(p, s, spec, None))
    assert spec.stats.accepted < spec.stats.proposed                          # rejections happened
    seq = p.seqs[:, :30]
    cache = p.stepper.cache
    assert cache.length == 29                                                 # all but the last token
    fresh = model.new_cache(1, 30)
    with torch.no_grad():
        model.step(seq[:, :29], fresh)
    for ours, ref in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(ours.k[:, :, :29], ref.k[:, :, :29], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.v[:, :, :29], ref.v[:, :, :29], rtol=1e-5, atol=1e-5)


# --- sampling: the model's distribution ---------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_accept_or_resample_gives_p_exactly(seed):
    """Σ_d q(d) [a(d) δ_d + (1 - a(d)) residual(p, q, d)] = p, for a draft q and for a certain draft."""
    g = torch.Generator().manual_seed(seed)
    v = 6
    p = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 2, -1)
    p[0] = 0.0                                           # a token the filters removed from p
    p /= p.sum()
    out = torch.zeros(v, dtype=torch.float64)
    for d in range(v):
        a = acceptance(p[None], q[None], torch.tensor([d]))[0]
        out += q[d] * (a * torch.eye(v, dtype=torch.float64)[d] + (1 - a) * residual(p, q, d))
        certain = acceptance(p[None], None, torch.tensor([d]))[0]
        one_hot = certain * torch.eye(v, dtype=torch.float64)[d] + (1 - certain) * residual(p, None, d)
        torch.testing.assert_close(one_hot, p)
    torch.testing.assert_close(out, p)
    torch.testing.assert_close(residual(p, p, 2), p)                 # nothing left over: p itself


def continuation_probs(model, prompt, n, **settings):
    """The exact probability of every continuation of n tokens under plain sampling (one forward per prefix)."""
    vocab = model.cfg.vocab_size
    out = {}
    for seq in itertools.product(range(vocab), repeat=n):
        prob, ids = 1.0, prompt.clone()
        for t in seq:
            with torch.no_grad():
                logits = model(ids)[:, -1].float()
            seen = torch.zeros(1, vocab, dtype=torch.bool)
            seen[0, ids[0]] = True
            prob *= float(torch.softmax(process_logits(logits, seen, do_sample=True, **settings), -1)[0, t])
            ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
        out[seq] = prob
    return out


@pytest.mark.parametrize("draft", ["model", "lookup"])
def test_sampled_continuations_follow_the_models_processed_distribution(draft):
    vocab, n, runs = 3, 3, 3000
    model = build(0, vocab=vocab)
    with torch.no_grad():
        model.lm_head.weight.div_(10)                     # a spread-out distribution: every outcome is seen
    other = build(5, vocab=vocab, n_layers=1)
    with torch.no_grad():
        other.lm_head.weight.div_(10)
    prompt = torch.tensor([[0, 1, 2, 0, 1]])
    settings = dict(temperature=0.8, top_k=None, top_p=0.97, repetition_penalty=1.3)
    expected = continuation_probs(model, prompt, n, **settings)
    source = dict(draft_model=other) if draft == "model" else dict(prompt_lookup=2)
    stats, counts = SpeculativeStats(), dict.fromkeys(expected, 0)
    for seed in range(runs):
        out = model.generate(prompt, max_new_tokens=n, do_sample=True, seed=seed, eos_token_id=[],
                             num_draft_tokens=2, speculative_stats=stats, **source, **settings)
        counts[tuple(out[0, 5:].tolist())] += 1
    assert 0 < stats.accepted < stats.proposed                # both branches of the rule ran
    statistic = sum((counts[k] - runs * e) ** 2 / (runs * e) for k, e in expected.items())
    assert statistic < chi2.ppf(1 - 1e-4, len(expected) - 1), (counts, expected)


# --- bad arguments ------------------------------------------------------------------------------------

def encoder_decoder():
    torch.manual_seed(0)
    return EncoderDecoder(ModelConfig(kind="encoder-decoder", vocab_size=29, d_model=32, n_heads=4, n_layers=1,
                                      d_ff=64, max_seq_len=64)).eval()


@pytest.mark.parametrize("case, kwargs, ids, message", [
    ("both", dict(draft_model="self", prompt_lookup=2), (1, 4), "not both"),
    ("k zero", dict(prompt_lookup=2, num_draft_tokens=0), (1, 4), "num_draft_tokens=0"),
    ("k negative", dict(draft_model="self", num_draft_tokens=-3), (1, 4), "num_draft_tokens=-3"),
    ("k not an int", dict(draft_model="self", num_draft_tokens=2.5), (1, 4), "num_draft_tokens=2.5"),
    ("ngram zero", dict(prompt_lookup=0), (1, 4), "prompt_lookup=0"),
    ("k alone", dict(num_draft_tokens=3), (1, 4), "need a draft"),
    ("other vocabulary", dict(draft_model="vocab30"), (1, 4), "vocab_size=30"),
    ("encoder-decoder draft", dict(draft_model="seq2seq"), (1, 4), "must be a decoder"),
    ("short draft context", dict(draft_model="context8"), (1, 4), "max_seq_len=8"),
    ("batch", dict(prompt_lookup=2), (2, 4), "batch size 1"),
    ("beams", dict(prompt_lookup=2, num_beams=2), (1, 4), "beam search"),
    ("samples", dict(prompt_lookup=2, do_sample=True, num_return_sequences=2), (1, 4), "num_return_sequences"),
    ("padding", dict(prompt_lookup=2, attention_mask=torch.tensor([[0, 1, 1, 1]])), (1, 4), "unpadded"),
    ("no cache", dict(prompt_lookup=2, use_cache=False), (1, 4), "KV cache"),
])
def test_bad_arguments_are_one_config_error(case, kwargs, ids, message):
    model = build(0)
    drafts = {"self": model, "vocab30": build(1, vocab=30), "seq2seq": encoder_decoder(),
              "context8": build(1, max_seq_len=8)}
    if isinstance(kwargs.get("draft_model"), str):
        kwargs = {**kwargs, "draft_model": drafts[kwargs["draft_model"]]}
    with pytest.raises(ConfigError, match=message):
        model.generate(rand_ids(*ids[1:]).expand(ids[0], -1), max_new_tokens=5, **kwargs)


def test_an_encoder_decoder_model_is_refused():
    with pytest.raises(ConfigError, match="encoder-decoder"):
        encoder_decoder().generate(rand_ids(4), max_new_tokens=3, prompt_lookup=2)


# --- tformer generate ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    chars = Tokenizer.char("to be, or not to be: that is the question")
    other = Tokenizer.char("a completely different text: xyz!")
    root = tmp_path_factory.mktemp("spec")
    cfg = dict(vocab_size=chars.vocab_size, eos_token_id=chars.eos_id)
    tformer.save(build(0, **cfg), root / "model", tokenizer=chars)
    tformer.save(build(1, n_layers=1, **cfg), root / "draft", tokenizer=chars)
    tformer.save(build(1, **{**cfg, "vocab_size": other.vocab_size}), root / "other", tokenizer=other)
    torch.manual_seed(0)
    seq2seq = EncoderDecoder(ModelConfig(kind="encoder-decoder", d_model=32, n_heads=4, n_layers=1, d_ff=64,
                                         max_seq_len=64, **cfg))
    tformer.save(seq2seq, root / "seq2seq", tokenizer=chars)
    return {name: str(root / name) for name in ("model", "draft", "other", "seq2seq")}


def test_cli_speculative_greedy_prints_plain_greedy_text_and_the_acceptance(runs, capsys):
    args = ["generate", "--model", runs["model"], "--prompt", "to be, or not to be", "--greedy",
            "--max-new-tokens", "40"]
    assert main(args) == 0
    plain = capsys.readouterr()
    assert "speculative" not in plain.err
    for flags in (["--draft-model", runs["draft"], "--num-draft-tokens", "3"], ["--prompt-lookup", "2"]):
        assert main(args + flags) == 0
        out = capsys.readouterr()
        assert out.out == plain.out
        lines = out.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("speculative: ") and "drafted tokens accepted" in lines[0]


@pytest.mark.parametrize("flags, message", [
    (["--num-draft-tokens", "3"], "--num-draft-tokens needs"),
    (["--draft-model", "{draft}", "--prompt-lookup", "2"], "not both"),
    (["--draft-model", "{other}"], "another tokenizer"),
    (["--draft-model", "{seq2seq}"], "must be a decoder"),
    (["--prompt-lookup", "2", "--num-beams", "2"], "beam search"),
    (["--num-draft-tokens", "0", "--prompt-lookup", "2"], "--num-draft-tokens"),
    (["--prompt-lookup", "-1"], "--prompt-lookup"),
])
def test_cli_bad_speculative_flags_print_one_error_line(runs, capsys, flags, message):
    flags = [f.format(**runs) for f in flags]
    try:                                   # argparse-level checks exit, the library's are returned
        code = main(["generate", "--model", runs["model"], "--prompt", "to be", "--max-new-tokens", "5"] + flags)
    except SystemExit as e:
        code = e.code
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], captured.err
