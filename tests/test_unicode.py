"""Any Unicode text, in any script: tokenizers round-trip it and generation never crashes on it.

Property tests (hypothesis) over random strings drawn from every Unicode category except lone
surrogates (which are not text: no UTF-8 encoding exists for them): CJK, emoji, right-to-left
scripts, combining marks, control characters, NUL, and edge cases hypothesis finds.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tformer
from tformer import Decoder, EncoderDecoder, ModelConfig
from tformer.cli import main
from tformer.data.files import read_text
from tformer.data.tokenizers import Tokenizer
from tformer.errors import DataError
from tformer.generation import stream_text

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)
# Strings that stress specific scripts, mixed into the random ones.
SAMPLES = ["日本語のテキスト", "👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽", "שָׁלוֹם עולם", "مرحبا بالعالم", "e\u0301\u0302\u0303 Z͑ͫ̓ͪ̂ͫ̽͏̴̙̤̞͉͚̯̞̠͍",
           "a\x00b\x00\x00", "\r\n\t\x0b\x0c\u2028\u2029", "<pad><eos> [CLS]", "\ufeff\ufffd\U0010ffff", ""]
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
CORPUS = "The quick brown fox jumps over the lazy dog. " * 20 + "".join(SAMPLES)


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.train_bpe(CORPUS, vocab_size=300)


@pytest.mark.parametrize("text", SAMPLES)
def test_char_round_trip_on_hard_samples(text):
    if text:
        tok = Tokenizer.char(text)
        assert tok.decode(tok.encode(text)) == text


@given(text=TEXT.filter(bool))
@PROPERTY
def test_char_tokenizer_round_trips_any_text_it_was_built_from(text):
    tok = Tokenizer.char(text)
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per code point, nothing merged or dropped
    assert tok.decode(ids) == text


@given(text=TEXT)
@PROPERTY
def test_char_tokenizer_saved_and_loaded_round_trips(tmp_path, text):
    tok = Tokenizer.char(CORPUS + text)
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    loaded = Tokenizer.from_file(path)
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(loaded.encode(text)) == text


@given(text=TEXT)
@PROPERTY
def test_byte_level_bpe_round_trips_any_text(bpe, text):
    # Byte-level: every string is bytes the vocabulary covers, even scripts never seen in training.
    assert bpe.decode(bpe.encode(text)) == text


@given(text=TEXT)
@PROPERTY
def test_byte_level_bpe_saved_and_loaded_round_trips(bpe, tmp_path, text):
    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    assert Tokenizer.from_file(path).decode(bpe.encode(text)) == text


# --- generation on arbitrary prompts -------------------------------------------------------------
def tiny_cfg(kind: str, vocab: int, **kw) -> ModelConfig:
    return ModelConfig(kind=kind, vocab_size=vocab, d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=96,
                       dropout=0.0, **kw)


@pytest.fixture(scope="module")
def models(bpe, tmp_path_factory):
    torch.manual_seed(0)
    char = Tokenizer.char("abcdefgh ")  # most random characters are unknown to it: <unk>
    lm = Decoder(tiny_cfg("decoder", bpe.vocab_size, eos_token_id=bpe.eos_id, bos_token_id=bpe.bos_id)).eval()
    char_lm = Decoder(tiny_cfg("decoder", char.vocab_size)).eval()
    s2s = EncoderDecoder(tiny_cfg("encoder-decoder", bpe.vocab_size, positional="sinusoidal",
                                  decoder_start_token_id=bpe.bos_id, eos_token_id=bpe.eos_id)).eval()
    root = tmp_path_factory.mktemp("models")
    tformer.save(lm, root / "lm", tokenizer=bpe)
    return {"lm": (lm, bpe), "char": (char_lm, char), "s2s": (s2s, bpe), "dir": root / "lm"}


@given(prompt=TEXT, which=st.sampled_from(["lm", "char", "s2s"]), greedy=st.booleans())
@PROPERTY
def test_generation_on_any_prompt_never_crashes(models, prompt, which, greedy):
    model, tok = models[which]
    n_prompt = len(tok.encode(prompt))
    if n_prompt + 4 > model.cfg.max_seq_len:
        return  # a prompt beyond the context is a clear error, tested in test_reliability.py
    text = "".join(stream_text(model, tok, prompt, max_new_tokens=4, do_sample=not greedy, temperature=1.0,
                               top_k=5, generator=torch.Generator().manual_seed(0)))
    assert isinstance(text, str)
    text.encode("utf-8")  # whole characters only: never half of a multi-byte sequence


@given(prompt=TEXT)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_generate_command_on_any_prompt_succeeds_or_says_why(models, prompt, capsys):
    assume(prompt != "-")  # the documented "read the prompt from stdin"
    capsys.readouterr()
    rc = main(["generate", "--model", str(models["dir"]), f"--prompt={prompt}", "--max-new-tokens", "3",
               "--seed", "0"])
    out, err = capsys.readouterr()
    if len(models["lm"][1].encode(prompt)) < models["lm"][0].cfg.max_seq_len:  # the CLI slides past the context
        assert rc == 0, err
        assert out.startswith(prompt)  # the prompt is echoed exactly, whatever its script
    else:
        assert rc == 2 and err.startswith("error:") and err.count("\n") == 1


# --- files that are not UTF-8 ---------------------------------------------------------------------
@given(before=TEXT, after=TEXT, bad=st.sampled_from([b"\xff", b"\xc3", b"\xe9t", b"\xed\xa0\x80", b"\xf8\x88"]),
       bom=st.booleans())
@PROPERTY
def test_invalid_utf8_is_named_by_byte_offset_or_replaced(tmp_path, before, after, bad, bom):
    before = before.replace("\x00", "") + "x"  # NUL marks a binary file; a non-blank text
    head = (b"\xef\xbb\xbf" if bom else b"") + before.encode("utf-8")
    path = tmp_path / "data.txt"
    path.write_bytes(head + bad + after.replace("\x00", "").encode("utf-8"))
    line = head.count(b"\n") + 1
    with pytest.raises(DataError, match=rf"byte {len(head)} \(line {line}\)"):
        read_text(path)
    text = read_text(path, errors="replace")
    assert text.startswith(before.replace("\r\n", "\n")) and "\ufffd" in text


@given(raw=st.binary(max_size=40))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_bytes_as_a_prompt_succeed_or_name_the_byte(models, raw, capsys):
    # Python passes argv / stdin bytes that are not UTF-8 on as lone surrogates (surrogateescape).
    prompt = raw.decode("utf-8", "surrogateescape")
    capsys.readouterr()
    rc = main(["generate", "--model", str(models["dir"]), f"--prompt={prompt}", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        assert rc == 2 and err == f"error: the text is not UTF-8: byte {e.start} is 0x{raw[e.start]:02x} " \
                                  "(convert the input to UTF-8)\n"
    else:
        assert rc in (0, 2) and (rc == 0 or err.startswith("error:")), err
