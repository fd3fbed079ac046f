"""save / load: identical outputs, strict and clear errors, run directories, no pickle."""

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tformer
from tformer import CheckpointError, Decoder, Encoder, EncoderClassifier, EncoderDecoder, ModelConfig
from tformer.checkpoints.format import sha256


def tiny(kind, **kw):
    return ModelConfig(kind=kind, vocab_size=19, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_seq_len=16, **kw)


def make(arch, tie=True, seed=0):
    torch.manual_seed(seed)
    if arch is EncoderClassifier:
        return EncoderClassifier(tiny("encoder", tie_embeddings=tie), 3, labels=["a", "b", "c"])
    kind = {Encoder: "encoder", Decoder: "decoder", EncoderDecoder: "encoder-decoder"}[arch]
    return arch(tiny(kind, tie_embeddings=tie, positional="sinusoidal" if arch is EncoderDecoder else "learned"))


def run(model):
    x = torch.arange(6).reshape(1, 6) % 19
    with torch.no_grad():
        return model(x, x[:, :4]) if isinstance(model, EncoderDecoder) else model(x)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("arch", [Encoder, EncoderClassifier, Decoder, EncoderDecoder])
def test_save_load_round_trip_gives_identical_outputs(tmp_path, arch, tie):
    model = make(arch, tie).eval()
    tformer.save(model, tmp_path / "ckpt", meta={"task": "test"})
    loaded = tformer.load(tmp_path / "ckpt")
    assert type(loaded) is arch and loaded.cfg == model.cfg and not loaded.training
    assert torch.equal(run(loaded), run(model))
    if arch is Decoder:
        assert (loaded.lm_head.weight is loaded.stack.embed.token.weight) == tie
    if arch is EncoderClassifier:
        assert loaded.labels == ["a", "b", "c"]
    data = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert data["architecture"] == arch.__name__ and data["meta"] == {"task": "test"}
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]


def test_no_pickle_anywhere(tmp_path, monkeypatch):
    tformer.save(make(Decoder), tmp_path / "ckpt")
    def refuse(*a, **k):
        raise AssertionError("pickle used")
    for mod, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)
    tformer.load(tmp_path / "ckpt")
    for f in (tmp_path / "ckpt").iterdir():
        assert not f.read_bytes().startswith(b"\x80")                  # pickle protocol 2+ magic
        assert not f.read_bytes().startswith(b"PK")                    # torch.save zip archive


class FakeTokenizer:
    def save(self, path):
        Path(path).write_text('{"model": {"type": "fake"}}')


def test_tokenizer_is_saved_and_checksummed(tmp_path):
    tformer.save(make(Decoder), tmp_path / "ckpt", tokenizer=FakeTokenizer())
    data = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert data["files"]["tokenizer.json"] == sha256(tmp_path / "ckpt" / "tokenizer.json")
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="tokenizer.json is corrupt"):
        tformer.load(tmp_path / "ckpt")


def test_failed_save_keeps_the_old_checkpoint(tmp_path):
    old = make(Decoder, seed=1)
    tformer.save(old, tmp_path / "ckpt")

    class Broken:
        def save(self, path):
            raise OSError("disk full")
    with pytest.raises(OSError):
        tformer.save(make(Decoder, seed=2), tmp_path / "ckpt", tokenizer=Broken())
    assert torch.equal(run(tformer.load(tmp_path / "ckpt")), run(old))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]              # no temporary directory left


# --- damaged checkpoints ----------------------------------------------------------------------------

@pytest.fixture
def ckpt(tmp_path):
    return tformer.save(make(Decoder, tie=False), tmp_path / "ckpt")


def rewrite_weights(ckpt, change):
    """Edit the weights and update the checksum, so loading gets past the integrity check."""
    state = load_file(str(ckpt / "model.safetensors"))
    change(state)
    save_file(state, str(ckpt / "model.safetensors"))
    data = json.loads((ckpt / "config.json").read_text())
    data["files"]["model.safetensors"] = sha256(ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps(data))


def test_missing_key(ckpt):
    rewrite_weights(ckpt, lambda s: s.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="missing lm_head.weight"):
        tformer.load(ckpt)


def test_unexpected_key(ckpt):
    rewrite_weights(ckpt, lambda s: s.update(extra=torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected extra"):
        tformer.load(ckpt)


def test_wrong_shape(ckpt):
    rewrite_weights(ckpt, lambda s: s.update({"lm_head.weight": torch.zeros(19, 8)}))
    with pytest.raises(CheckpointError, match=r"lm_head.weight has shape \(19, 8\).*expects \(19, 16\)"):
        tformer.load(ckpt)


def test_corrupt_config_json(ckpt):
    (ckpt / "config.json").write_text('{"format": "tformer", "archit')
    with pytest.raises(CheckpointError, match="config.json is corrupt"):
        tformer.load(ckpt)


def test_invalid_model_config_inside_config_json(ckpt):
    data = json.loads((ckpt / "config.json").read_text())
    data["config"]["n_heads"] = 3
    (ckpt / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="n_heads"):
        tformer.load(ckpt)


def test_hugging_face_directory_gets_a_hint(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(CheckpointError, match="import-hf"):
        tformer.load(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_weights_fail_the_checksum(ckpt, damage):
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        tformer.load(ckpt)


def test_unreadable_weights_with_matching_checksum(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    data = json.loads((ckpt / "config.json").read_text())
    data["files"]["model.safetensors"] = sha256(f)
    (ckpt / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="cannot be read as safetensors"):
        tformer.load(ckpt)


def test_missing_weights_file_and_missing_directory(ckpt, tmp_path):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        tformer.load(ckpt)
    with pytest.raises(CheckpointError, match="does not exist"):
        tformer.load(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="not a tformer checkpoint"):
        tformer.load(tmp_path / "ckpt" / "..")


def test_run_directory_loads_the_newest_complete_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    models = {step: make(Decoder, seed=step) for step in (9, 10)}
    for step, model in models.items():
        tformer.save(model, run_dir / "checkpoints" / f"step-{step:07d}")
    (run_dir / "checkpoints" / "step-0000011").mkdir()                   # incomplete: no config.json
    assert torch.equal(run(tformer.load(run_dir)), run(models[10]))
    # Unpadded step numbers still sort by number, not as text (step-9 < step-10).
    other = tmp_path / "other"
    for step, model in models.items():
        tformer.save(model, other / "checkpoints" / f"step-{step}")
    assert torch.equal(run(tformer.load(other)), run(models[10]))
