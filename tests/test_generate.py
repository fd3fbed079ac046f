"""Generation: each logits processor equals Hugging Face's, sampling draws from the processed
distribution, cache / batching / beams give the same tokens as their references (uncached,
one-by-one, HF beam search), stop sequences and strings, streaming text, argument checks, CLI."""

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tformer
from hf_util import save_hf, transformers
from tformer import Decoder, EncoderDecoder, ModelConfig
from tformer.cli import main
from tformer.data.tokenizers import Tokenizer
from tformer.generation import (
    TextStream,
    apply_repetition_penalty,
    apply_temperature,
    greedy,
    min_p_filter,
    sequence_hits,
    stream_text,
    top_k_filter,
    top_p_filter,
    windowed,
)
from tformer.generation.beam import top_k_indices

lp = pytest.importorskip("transformers.generation.logits_process")


def tiny(kind="decoder", **kw):
    base = dict(kind=kind, vocab_size=29, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=128)
    return ModelConfig(**{**base, **kw})


def build(cls, seed=0, **kw):
    torch.manual_seed(seed)
    model = cls(tiny("encoder-decoder" if cls is EncoderDecoder else "decoder", **kw))
    with torch.no_grad():                       # spread the logits so greedy choices are clear-cut
        model.lm_head.weight.mul_(20)
    return model.eval().double()


def rand_ids(*shape, seed=0, vocab=29):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# --- processors equal HF's warpers ------------------------------------------------------------------

def logits_strategy():
    """(B, V) random logits; with `ties`, values on a coarse grid so equal logits are common."""
    return st.tuples(st.integers(1, 4), st.integers(2, 60), st.integers(0, 2**31 - 1), st.booleans()).map(_logits)


def _logits(args):
    b, v, seed, ties = args
    x = torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3
    return x.round() if ties else x


@settings(max_examples=60, deadline=None)
@given(logits_strategy(), st.floats(0.05, 5.0))
def test_temperature_equals_hf(x, t):
    torch.testing.assert_close(apply_temperature(x, t), lp.TemperatureLogitsWarper(t)(None, x.clone()))


@settings(max_examples=60, deadline=None)
@given(logits_strategy(), st.integers(1, 70), st.integers(1, 3))
def test_top_k_equals_hf(x, k, keep):
    expected = lp.TopKLogitsWarper(k, min_tokens_to_keep=keep)(None, x.clone())
    assert torch.equal(top_k_filter(x, k, keep), expected)


@settings(max_examples=60, deadline=None)
@given(logits_strategy(), st.floats(0.01, 1.0), st.integers(1, 3))
def test_top_p_equals_hf(x, p, keep):
    expected = lp.TopPLogitsWarper(p, min_tokens_to_keep=keep)(None, x.clone())
    assert torch.equal(top_p_filter(x, p, keep), expected)


@settings(max_examples=60, deadline=None)
@given(logits_strategy(), st.floats(0.0, 1.0), st.integers(1, 3))
def test_min_p_equals_hf(x, m, keep):
    expected = lp.MinPLogitsWarper(m, min_tokens_to_keep=keep)(None, x.clone())
    assert torch.equal(min_p_filter(x, m, keep), expected)


@settings(max_examples=60, deadline=None)
@given(logits_strategy(), st.floats(0.5, 3.0), st.integers(1, 12), st.integers(0, 1000))
def test_repetition_penalty_equals_hf(x, penalty, length, seed):
    ids = torch.randint(0, x.size(1), (x.size(0), length), generator=torch.Generator().manual_seed(seed))
    seen = torch.zeros(x.shape, dtype=torch.bool).scatter(1, ids, True)
    expected = lp.RepetitionPenaltyLogitsProcessor(penalty)(ids, x.clone())
    torch.testing.assert_close(apply_repetition_penalty(x, seen, penalty), expected)


def test_greedy_picks_what_torch_argmax_picks():
    torch.manual_seed(0)
    x = torch.randint(0, 4, (64, 50)).float()                     # many ties: the first one wins
    x[3, 7] = x[5, 0] = x[5, 9] = float("nan")                      # NaN is the largest
    for logits in (x, x[:, ::2], x.bfloat16(), torch.randn(8, 50257), torch.randn(2, 3).requires_grad_()):
        got = greedy(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))


# --- sampling -----------------------------------------------------------------------------------------

def test_sampling_limits_are_greedy():
    model = build(Decoder, positional="rope")
    prompt = rand_ids(3, 5, seed=1)
    greedy = model.generate(prompt, max_new_tokens=30, do_sample=False)
    for limit in (dict(top_k=1), dict(top_k=0, top_p=1e-9), dict(temperature=1e-6), dict(temperature=0)):
        sampled = model.generate(prompt, max_new_tokens=30, do_sample=True, seed=7, **limit)
        assert torch.equal(sampled, greedy), limit


def test_sampled_frequencies_match_the_processed_distribution():
    """10 000 seeded first tokens vs HF's warpers applied to the model's own logits: total
    variation within 4 standard errors, and filtered tokens never drawn."""
    model, n = build(Decoder, seed=3).float(), 10_000
    prompt = rand_ids(1, 4, seed=2)
    with torch.no_grad():
        logits = model(prompt)[:, -1].float()
    for t, k, p in [(1.5, 12, 0.9), (0.7, 0, 0.95), (2.0, 5, 1.0)]:
        ref = logits.clone()
        for warper in [lp.TemperatureLogitsWarper(t), lp.TopKLogitsWarper(k) if k else None,
                       lp.TopPLogitsWarper(p) if p < 1 else None]:
            ref = warper(None, ref) if warper is not None else ref
        probs = ref.softmax(-1)[0].double()
        out = model.generate(prompt, max_new_tokens=1, do_sample=True, temperature=t, top_k=k, top_p=p,
                             num_return_sequences=n, generator=torch.Generator().manual_seed(0), eos_token_id=[])
        freq = torch.bincount(out[:, -1], minlength=probs.numel()).double() / n
        assert freq[probs == 0].sum() == 0
        tv = 0.5 * (freq - probs).abs().sum()
        assert tv < 0.5 * 3 * (probs * (1 - probs) / n).sqrt().sum() + 1e-3, (t, k, p, tv)


def test_same_seed_same_tokens_and_no_global_rng():
    model, prompt = build(Decoder), rand_ids(2, 3)
    state = torch.get_rng_state()
    a = model.generate(prompt, max_new_tokens=20, do_sample=True, seed=5)
    b = model.generate(prompt, max_new_tokens=20, do_sample=True, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and torch.equal(torch.get_rng_state(), state)


# --- cache, padding -----------------------------------------------------------------------------------

@pytest.mark.parametrize("positional", ["learned", "sinusoidal", "rope"])
def test_decoder_cached_equals_uncached_over_100_steps(positional):
    model = build(Decoder, positional=positional, n_kv_heads=2 if positional == "rope" else None)
    ids, mask = rand_ids(2, 6, seed=3), torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    cached = model.generate(ids, mask, max_new_tokens=110, eos_token_id=[])
    assert cached.shape == (2, 116)
    assert torch.equal(cached, model.generate(ids, mask, max_new_tokens=110, eos_token_id=[], use_cache=False))


def test_encoder_decoder_cached_equals_uncached_over_100_steps():
    model = build(EncoderDecoder, positional="sinusoidal", norm_position="post", decoder_start_token_id=0)
    src, mask = rand_ids(2, 7, seed=4), torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    cached = model.generate(src, mask, max_new_tokens=105, eos_token_id=[])
    assert cached.shape == (2, 106) and (cached[:, 0] == 0).all()
    assert torch.equal(cached, model.generate(src, src_mask=mask, max_new_tokens=105, eos_token_id=[],
                                              use_cache=False))


def test_left_padded_batch_equals_one_by_one():
    model = build(Decoder, eos_token_id=5, pad_token_id=0)
    prompts = [rand_ids(1, n, seed=n)[0] for n in (7, 2, 4)]
    ids = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 7 - len(p):], mask[i, 7 - len(p):] = p, 1
    batched = model.generate(ids, mask, max_new_tokens=25, repetition_penalty=1.3)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=25, repetition_penalty=1.3)[0, len(p):]
        new = batched[i, 7:]
        assert torch.equal(new[:len(alone)], alone)
        assert (new[len(alone):] == 0).all()                     # finished rows are padded


# --- stop sequences and streaming ---------------------------------------------------------------------

def scripted(script: list[int], vocab: int) -> Decoder:
    """A Decoder whose greedy choice at position p is script[p + 1], whatever the tokens: only
    position embeddings (one-hot) reach the output layer; attention and FFN write zeros."""
    n = len(script)
    model = Decoder(ModelConfig(vocab_size=vocab, d_model=n, n_heads=1, n_layers=1, d_ff=4, max_seq_len=n,
                                tie_embeddings=False, eos_token_id=None))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.zero_() if "norm" not in name else p.fill_(1.0 if name.endswith("weight") else 0.0)
        model.stack.embed.position.weight.copy_(torch.eye(n))
        for pos in range(n - 1):
            model.lm_head.weight[script[pos + 1], pos] = 10.0
    return model.eval()


@pytest.mark.parametrize("stream, stop, expected", [
    ([1, 1, 2, 3, 4], [1, 2], [1, 1, 2]),              # A A B stops on A B
    ([1, 1, 1, 2, 3], [1, 1, 2], [1, 1, 1, 2]),        # A A A B stops on A A B
    ([1, 2, 1, 2, 3], [2, 3], [1, 2, 1, 2, 3]),
])
def test_overlapping_stop_sequences(stream, stop, expected):
    model = scripted([0] + stream + [4, 4], vocab=6)
    out = model.generate(torch.tensor([[0]]), max_new_tokens=6, stop_sequences=[stop, [5, 5]])
    assert out[0, 1:].tolist() == expected
    both = model.generate(torch.tensor([[0], [0]]), max_new_tokens=6, stop_sequences=[stop], pad_token_id=5)
    assert both[1, 1:].tolist() == expected


def test_sequence_hits_checks_every_suffix():
    gen = torch.tensor([[1, 1, 2], [1, 2, 2], [2, 1, 1]])
    assert sequence_hits(gen, [torch.tensor([1, 2])]).tolist() == [True, False, False]


@pytest.fixture(scope="module")
def chars():
    return Tokenizer.char("xhelo wrd\n!é")


def test_stop_strings_end_the_text_before_the_stop(chars):
    text = "xhello\n\nworld!!"
    model = scripted(chars.encode(text), chars.vocab_size)
    run = dict(max_new_tokens=len(text) - 1, do_sample=False)
    assert "".join(stream_text(model, chars, "x", **run)) == "hello\n\nworld!!"
    assert "".join(stream_text(model, chars, "x", stop_strings=["\n\n"], **run)) == "hello"
    assert "".join(stream_text(model, chars, "x", stop_strings=["\n\n"], include_stop=True, **run)) == "hello\n\n"
    assert "".join(stream_text(model, chars, "x", stop_strings=["lo!", "d!"], **run)) == "hello\n\nworl"
    ids = model.generate(torch.tensor([chars.encode("x")]), stop_strings=["wor"], tokenizer=chars, **run)
    assert chars.decode(ids[0]) == "xhello\n\nwor"                    # generation stops at the stop string


def test_text_stream_never_splits_a_utf8_character():
    text = "héllo wörld ✓ 日本語 😀!"
    tok = Tokenizer.train_bpe(["hello world"], vocab_size=262)          # non-ASCII characters stay byte tokens
    ids = tok.encode(text)
    assert len(ids) > len(text)
    stream = TextStream(tok)
    pieces = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    stopped = TextStream(tok, ["日本"])
    assert "".join([stopped.push([i]) for i in ids] + [stopped.finish()]) == "héllo wörld ✓ "
    model = scripted(ids, tok.vocab_size)                                # generates `text` from its first token
    out = model.generate(torch.tensor([ids[:1]]), max_new_tokens=len(ids) - 1, stop_strings=["日本"], tokenizer=tok)
    assert tok.decode(out[0]) == "héllo wörld ✓ 日本"                    # stops once the 6 bytes are complete


def test_streamer_and_stream_see_each_step():
    model, prompt = build(Decoder), rand_ids(2, 3)
    seen = []
    out = model.generate(prompt, max_new_tokens=8, streamer=seen.append, eos_token_id=[])
    assert torch.equal(torch.stack(seen, 1), out[:, 3:])
    assert torch.equal(torch.stack(list(model.stream(prompt, max_new_tokens=8, eos_token_id=[])), 1), out[:, 3:])


# --- beam search equals HF ------------------------------------------------------------------------------

BEAMS = [dict(length_penalty=1.0, early_stopping=False, num_return_sequences=1),
         dict(length_penalty=0.5, early_stopping=True, num_return_sequences=2),
         dict(length_penalty=2.0, early_stopping="never", num_return_sequences=4),
         dict(length_penalty=-1.0, early_stopping=False, num_return_sequences=3, repetition_penalty=1.5)]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    cfg = transformers.GPT2Config(vocab_size=13, n_embd=24, n_head=3, n_layer=2, n_positions=48,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=3)
    hf = save_hf(transformers.GPT2LMHeadModel(cfg), path, seed=1)
    return hf.double(), tformer.from_hf(path).double()


@pytest.mark.parametrize("case", range(len(BEAMS)))
def test_decoder_beam_search_equals_hf(gpt2, case):
    hf, ours = gpt2
    ids, mask = rand_ids(3, 5, seed=case, vocab=13), torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [1] * 5])
    if "repetition_penalty" in BEAMS[case]:
        mask[:] = 1          # HF also penalises the ids under left padding; tformer only real tokens
    eos = 2 if case == 2 else [2, 5, 7]           # several EOS ids: more hypotheses end early
    kw = dict(num_beams=4, max_new_tokens=14, eos_token_id=eos, pad_token_id=3, **BEAMS[case])
    with torch.no_grad():
        expected = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw)
    assert torch.equal(ours.generate(ids, mask, **kw), expected)
    if case == 0:
        assert torch.equal(ours.generate(ids, mask, use_cache=False, **kw), expected)


@pytest.mark.parametrize("family", ["bart", "marian"])
def test_encoder_decoder_beam_search_equals_hf(family, tmp_path):
    if family == "bart":
        cfg = transformers.BartConfig(vocab_size=14, d_model=24, encoder_attention_heads=3, decoder_attention_heads=3,
                                      encoder_layers=2, decoder_layers=1, encoder_ffn_dim=40, decoder_ffn_dim=40,
                                      max_position_embeddings=48, forced_eos_token_id=None)
        hf = save_hf(transformers.BartForConditionalGeneration(cfg), tmp_path, seed=2)
    else:
        cfg = transformers.MarianConfig(vocab_size=14, d_model=24, encoder_attention_heads=3,
                                        decoder_attention_heads=3, encoder_layers=1, decoder_layers=2,
                                        encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=48,
                                        scale_embedding=True, pad_token_id=13, decoder_start_token_id=13,
                                        eos_token_id=2, forced_eos_token_id=None)
        hf = save_hf(transformers.MarianMTModel(cfg), tmp_path, seed=3)
    hf, ours = hf.double(), tformer.from_hf(tmp_path).double()
    src, mask = rand_ids(2, 6, seed=5, vocab=14), torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    eos = [2, 5, 7] if family == "bart" else [2, 8]     # ids these random models do produce
    ended_early = []
    for case in BEAMS[:3]:
        kw = dict(num_beams=4, max_new_tokens=12, eos_token_id=eos, **case)
        with torch.no_grad():
            expected = hf.generate(input_ids=src, attention_mask=mask, do_sample=False, **kw)
        ended_early.append(bool(torch.isin(expected[:, 1:], torch.tensor(eos)).any()))
        assert torch.equal(ours.generate(src, mask, **kw), expected), case
    assert any(ended_early)                        # the finished-hypothesis bookkeeping was exercised


# --- argument checks and the CLI -------------------------------------------------------------------------

@pytest.mark.parametrize("bad, name", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=200), "max_new_tokens"),
    (dict(num_beams=0), "num_beams"), (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
    (dict(stop_strings=["x"]), "stop_strings"),
])
def test_bad_arguments_raise_value_error_naming_them(bad, name):
    with pytest.raises(ValueError, match=name):
        build(Decoder).generate(rand_ids(1, 3), **{"max_new_tokens": 5, **bad})


def test_source_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="max_seq_len"):
        build(EncoderDecoder, max_seq_len=8).generate(rand_ids(1, 9), max_new_tokens=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, chars):
    path = tmp_path_factory.mktemp("ckpt") / "model"
    torch.manual_seed(0)
    tformer.save(Decoder(tiny(vocab_size=chars.vocab_size, eos_token_id=chars.eos_id)), path, tokenizer=chars)
    return str(path)


def test_cli_streams_seeded_text_reproducibly(checkpoint, capsys, monkeypatch):
    args = ["generate", "--model", checkpoint, "--prompt", "hello", "--seed", "3", "--max-new-tokens", "30"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.startswith("hello")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello"))
    assert main(args[:3] + ["--prompt", "-"] + args[5:]) == 0
    assert capsys.readouterr().out == first
    beams = args[:5] + args[7:] + ["--num-beams", "2", "--no-echo", "--stop", "l"]    # (no --seed: beams do not sample)
    assert main(beams) == 0
    assert "l" not in capsys.readouterr().out


def test_cli_dtype_bf16_generates_as_the_checkpoint_loaded_in_bf16(checkpoint, chars, capsys, monkeypatch):
    """--dtype bf16: the weights are multiplied in bf16 (the same greedy text as tformer.load(dtype=bf16)),
    with a warning where the CPU has no bf16 units; --dtype fp32 is the default."""
    args = ["generate", "--model", checkpoint, "--prompt", "hello", "--greedy", "--max-new-tokens", "20", "--no-echo"]
    ids = torch.tensor([chars.encode("hello")])
    expected = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tformer.load(checkpoint, dtype=None if dtype == torch.float32 else dtype)
        assert {p.dtype for p in model.parameters()} == {dtype}
        expected[dtype] = chars.decode(model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.size(1):])
    loaded, load = [], tformer.checkpoints.format.load           # the dtype of the model the command runs
    monkeypatch.setattr("tformer.checkpoints.format.load", lambda *a, **k: (m := load(*a, **k), loaded.append(
        next(m.parameters()).dtype))[0])
    assert main(args) == 0 and capsys.readouterr().out.strip() == expected[torch.float32]
    monkeypatch.setattr("tformer.devices.native_bf16", lambda device: True)
    assert main(args + ["--dtype", "bf16"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == expected[torch.bfloat16] and out.err == ""
    monkeypatch.setattr("tformer.devices.native_bf16", lambda device: False)
    assert main(args + ["--dtype", "bf16"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == expected[torch.bfloat16]
    assert out.err.startswith("warning: --dtype bf16: this CPU has no bf16 units") and out.err.count("\n") == 1
    assert loaded == [torch.float32, torch.bfloat16, torch.bfloat16]


def test_cli_prompt_from_an_unreadable_stdin_is_one_error_line(checkpoint, capsys, monkeypatch):
    class Closed(io.StringIO):
        def read(self, *args):
            raise OSError("stdin is closed")
    monkeypatch.setattr("sys.stdin", Closed())
    assert main(["generate", "--model", checkpoint, "--prompt", "-"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --prompt - reads the prompt from stdin")


@pytest.mark.parametrize("flags, name", [(["--top-p", "1.5"], "top_p"), (["--temperature", "-1"], "temperature"),
                                         (["--top-k", "-2"], "top_k"), (["--max-new-tokens", "-5"], "max_new_tokens")])
def test_cli_bad_arguments_print_one_error_line(checkpoint, capsys, flags, name):
    try:                                   # argparse-level checks exit, the library's are returned
        code = main(["generate", "--model", checkpoint, "--prompt", "hi"] + flags)
    except SystemExit as e:
        code = e.code
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert name in lines[0] or "--" + name.replace("_", "-") in lines[0]      # the argument or its flag


def test_cli_writes_past_the_context_with_a_sliding_window(checkpoint, capsys):
    """A decoder asked for more tokens than its context holds continues from the last half-context;
    the library call itself still refuses (HF semantics)."""
    context = tformer.load(checkpoint).cfg.max_seq_len
    args = ["generate", "--model", checkpoint, "--prompt", "hello", "--seed", "1", "--greedy",
            "--max-new-tokens", str(2 * context)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert main(args) == 0 and capsys.readouterr().out == out
    assert len(out) > context  # char tokenizer: one character per token (EOS may end it early otherwise)
    with pytest.raises(ValueError, match="max_new_tokens|max_seq_len"):
        tformer.load(checkpoint).generate(rand_ids(1, 3), max_new_tokens=2 * context)


def test_windowed_restarts_from_the_last_half_context():
    """Past the context (8 positions), each round is plain greedy generate() from the last 4 tokens."""
    model = build(Decoder, max_seq_len=8)
    ids = [1, 2, 3]
    tokens = ids + [int(step[0]) for step in windowed(model, ids, 10, eos_token_id=[])]
    assert len(tokens) == 13
    for start, end in ((0, 8), (4, 12), (8, 13)):   # rounds: prompt + 5, then 4 + 4, then 4 + 1
        window = torch.tensor([tokens[start:start + (3 if start == 0 else 4)]])
        out = model.generate(window, max_new_tokens=end - start - window.size(1), eos_token_id=[])
        assert out[0].tolist() == tokens[start:end]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 8000), k=st.integers(1, 12), seed=st.integers(0, 2**16),
       crowded=st.booleans())
def test_top_k_indices_equal_torch_topk(rows, vocab, k, seed, crowded):
    k = min(k, vocab)
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    if crowded:      # the k best in one chunk of columns, or in the ragged end past the last full chunk
        x[:, -k:] += 10
        x[0, :k] += 20
    assert torch.equal(top_k_indices(x, k), torch.topk(x, k, dim=-1).indices)
