"""Broken or unsupported Hugging Face directories fail with one line naming the problem, in the API
(an exception) and in the CLI (`error: ...`, exit 2); the CLI never overwrites what the user has."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import tformer
from hf_util import save_hf, state_equal, transformers
from tformer.cli import main
from tformer.errors import CheckpointError, ConfigError

GPT2 = dict(vocab_size=61, n_embd=24, n_head=3, n_layer=2, n_positions=32)


@pytest.fixture
def gpt2_dir(tmp_path):
    save_hf(transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)), tmp_path / "gpt2")
    return tmp_path / "gpt2"


def edit_weights(path, change):
    state = load_file(path / "model.safetensors")
    change(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(gpt2_dir):
    edit_weights(gpt2_dir, lambda s: s.pop("transformer.h.1.mlp.c_fc.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) h\.1\.mlp\.c_fc\.bias"):
        tformer.from_hf(gpt2_dir)


def test_wrong_shape_is_named(gpt2_dir):
    edit_weights(gpt2_dir, lambda s: s.update({"transformer.wpe.weight": torch.zeros(31, 24)}))
    with pytest.raises(CheckpointError, match=r"wpe\.weight has shape \(31, 24\), config.json implies \(32, 24\)"):
        tformer.from_hf(gpt2_dir)


def test_unexpected_tensor_is_named(gpt2_dir):
    edit_weights(gpt2_dir, lambda s: s.update({"transformer.h.2.ln_1.weight": torch.ones(24)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) h\.2\.ln_1\.weight"):
        tformer.from_hf(gpt2_dir)


def test_unsupported_model_type_is_named(tmp_path):
    transformers.WhisperConfig(d_model=16, encoder_layers=1, decoder_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="model_type='whisper' is not supported"):
        tformer.from_hf(tmp_path)


def test_pytorch_model_bin_and_prefixless_files_load(gpt2_dir, tmp_path):
    """Older layouts: pytorch_model.bin (read with weights_only=True) holding GPT2Model's names,
    with the causal-mask buffers old GPT-2 files carry (declared as ignored)."""
    state = {k.removeprefix("transformer."): v for k, v in load_file(gpt2_dir / "model.safetensors").items()}
    state["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    old = tmp_path / "old"
    old.mkdir()
    torch.save(state, old / "pytorch_model.bin")
    (old / "config.json").write_text((gpt2_dir / "config.json").read_text())
    assert state_equal(tformer.from_hf(old), tformer.from_hf(gpt2_dir))


def test_sharded_safetensors_load(gpt2_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(gpt2_dir)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert state_equal(tformer.from_hf(tmp_path / "sharded"), tformer.from_hf(gpt2_dir))


def test_no_weights_and_no_config_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        tformer.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", **GPT2}))
    with pytest.raises(CheckpointError, match="no model.safetensors or pytorch_model.bin"):
        tformer.from_hf(tmp_path)


def test_cli_import_export_round_trip(gpt2_dir, tmp_path, capsys):
    assert main(["import-hf", str(gpt2_dir), str(tmp_path / "tf")]) == 0
    model = tformer.load(tmp_path / "tf")
    assert state_equal(model, tformer.from_hf(gpt2_dir))
    assert main(["export-hf", str(tmp_path / "tf"), str(tmp_path / "hf")]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(ids), rtol=1e-4, atol=1e-5)


def test_cli_errors_are_one_line_and_leave_files_alone(gpt2_dir, tmp_path, capsys):
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    assert main(["import-hf", str(gpt2_dir), str(dst)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--force" in err and err.count("\n") == 1
    assert (dst / "notes.txt").read_text() == "mine"

    edit_weights(gpt2_dir, lambda s: s.pop("transformer.ln_f.bias"))
    assert main(["import-hf", str(gpt2_dir), str(tmp_path / "new"), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "ln_f.bias" in err and err.count("\n") == 1
    assert not (tmp_path / "new").exists()

    assert main(["export-hf", str(gpt2_dir), str(tmp_path / "out")]) == 2     # an HF dir is not a tformer one
    assert "import-hf" in capsys.readouterr().err


@pytest.mark.parametrize("family, config_cls", [
    ("gpt2", "GPT2Config"), ("bert", "BertConfig"), ("marian", "MarianConfig"), ("bart", "BartConfig"),
    ("llama", "LlamaConfig")])
def test_defaults_for_omitted_keys_match_transformers(family, config_cls):
    """Older config.json files omit values equal to the default: tformer must assume the same ones."""
    from tformer.checkpoints.hf import FAMILIES, seq2seq

    fam = FAMILIES[family]
    defaults = {**(seq2seq.COMMON_DEFAULTS if family in ("marian", "bart") else {}), **fam.DEFAULTS}
    reference = getattr(transformers, config_cls)()
    legacy = {"position_embedding_type", "rope_theta", "rope_scaling", "rope_parameters", "head_dim",
              "num_key_value_heads", "decoder_vocab_size"}   # renamed in transformers 5 or derived at init
    for key, value in defaults.items():
        if key in legacy or not hasattr(reference, key):
            continue
        assert getattr(reference, key) == value, key


def test_tokenizer_travels_both_ways(gpt2_dir, tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(61)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(gpt2_dir / "tokenizer.json"))
    assert main(["import-hf", str(gpt2_dir), str(tmp_path / "tf")]) == 0
    assert Tokenizer.from_file(str(tmp_path / "tf" / "tokenizer.json")).get_vocab() == vocab
    assert main(["export-hf", str(tmp_path / "tf"), str(tmp_path / "hf")]) == 0
    assert Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).get_vocab() == vocab


def test_a_classifier_is_refused_for_export(tmp_path):
    cfg = tformer.preset("bert-base", vocab_size=30, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_seq_len=16)
    clf = tformer.EncoderClassifier(cfg, 2)
    with pytest.raises(ConfigError, match=r"\.encoder"):
        tformer.to_hf(clf, tmp_path / "x")
    tformer.to_hf(clf.encoder, tmp_path / "x")                 # its encoder is a BERT
    assert transformers.AutoConfig.from_pretrained(tmp_path / "x").model_type == "bert"
