"""tformer's own T5-style models: the t5-small preset's choices train through `tformer train --task
translate --preset t5-small` (its shape shrunk here, so the test takes seconds), and the trained run
translates, saves and reloads; the relative bias shows in `tformer trace`."""

import json

import pytest
import torch

from tformer import PRESETS, EncoderDecoder, ModelConfig
from tformer.checkpoints.format import load
from tformer.cli import main
from tformer.data import corpora
from tformer.data.tokenizers import Tokenizer
from tformer.errors import ConfigError
from tformer.inspect.trace import attention_maps, prepare, trace

TOK = Tokenizer.char("vingt et un twenty-one")

SHRUNK = dict(d_model=32, n_heads=3, head_size=8, n_layers=2, n_decoder_layers=1, d_ff=48, max_seq_len=64,
              dropout=0.0, ffn_dropout=0.0)


def test_t5_preset_trains_on_translation(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(PRESETS, "t5-small", {**PRESETS["t5-small"], **SHRUNK})
    data = tmp_path / "numbers.tsv"
    data.write_text("".join("\t".join(corpora.number_pair(n)) + "\n" for n in range(1, 31)), encoding="utf-8")
    run = tmp_path / "run"
    assert main(["train", "--task", "translate", "--data", str(data), "--preset", "t5-small", "--vocab-size", "300",
                 "--max-steps", "20", "--batch-size", "16", "--lr", "3e-3", "--warmup", "5", "--eval-every", "10",
                 "--eval-sentences", "2", "--val-fraction", "0.1", "--precision", "fp32", "--out", str(run),
                 "--no-progress"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0]
    model = load(run)
    assert (model.cfg.positional, model.cfg.attention_scale, model.cfg.norm) == ("relative", False, "rmsnorm")
    capsys.readouterr()
    assert main(["translate", "--model", str(run), "--num-beams", "2", "vingt et un"]) == 0
    assert capsys.readouterr().out.strip()


def t5_like():
    torch.manual_seed(0)
    return EncoderDecoder(ModelConfig(**{**PRESETS["t5-small"], **SHRUNK, "vocab_size": TOK.vocab_size,
                                         "pad_token_id": 0})).eval()


def test_trace_shows_the_unscaled_scores_and_the_relative_bias():
    model = t5_like()
    inputs = prepare(model, TOK, "vingt", target="twenty")
    text = trace(model, inputs, TOK, head=2)
    cfg = model.cfg
    assert sum("relative position bias" in line for line in text.splitlines()) == cfg.n_layers + cfg.decoder_layers
    assert text.count("S = Q Kᵀ  (unscaled") == cfg.n_layers + 2 * cfg.decoder_layers
    assert "check: traced output = model forward" in text


def test_attention_pictures_show_each_stacks_relative_bias():
    model = t5_like()
    maps = attention_maps(model, prepare(model, TOK, "vingt", target="twenty"))
    bias = [m for m in maps if "relative position bias" in m.name]
    assert [m.name.split()[0] for m in bias] == ["encoder", "decoder"]
    enc, dec = (torch.tensor(m.weights[0]) for m in bias)               # (H, T, T): softmax(b) per head
    assert enc.shape[0] == model.cfg.n_heads
    torch.testing.assert_close(enc.sum(-1), torch.ones(enc.shape[:2]))
    assert (dec.triu(1) == 0).all()                                       # causal: no later keys
    # the bias depends only on j - i: every diagonal of the encoder's b is constant
    b = model.encoder.relative_bias(6, 6)[0]
    for d in range(-5, 6):
        diag = b.diagonal(offset=d, dim1=-2, dim2=-1)
        assert torch.equal(diag, diag[:, :1].expand_as(diag))


def test_trace_of_an_encoder_decoder_whose_stacks_differ_in_heads():
    torch.manual_seed(0)
    cfg = ModelConfig(kind="encoder-decoder", vocab_size=TOK.vocab_size, d_model=24, n_heads=6, n_decoder_heads=2,
                      n_layers=1, d_decoder_ff=20, pad_token_id=0)
    model = EncoderDecoder(cfg).eval()
    inputs = prepare(model, TOK, "vingt", target="twenty")
    assert "check: traced output = model forward" in trace(model, inputs, TOK, head=1)
    with pytest.raises(ConfigError, match="heads 0..1 in every stack"):
        trace(model, inputs, TOK, head=4)
