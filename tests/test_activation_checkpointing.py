"""Activation checkpointing (`--activation-checkpointing`, model/layers.py `checkpoint_activations`): the same
loss and gradients as without it, dropout included (its masks replayed in the recomputation), on every model
kind and on LoRA over an int8 base; fewer tensors kept for the backward; and the run's flag reaches the model."""

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import tformer
from tformer.inference.int8_embedding import quantize_base
from tformer.model.layers import Block, checkpoint_activations
from tformer.model.lora import apply_lora

SHAPES = {
    "llama": dict(kind="decoder", n_kv_heads=2, activation="swiglu", positional="rope", norm="rmsnorm", bias=False),
    "gpt": dict(kind="decoder", activation="gelu"),
    "bert": dict(kind="encoder", norm_position="post", activation="gelu"),
    "seq2seq": dict(kind="encoder-decoder", activation="relu", decoder_start_token_id=0),
}


def build(shape: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = tformer.ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=16,
                              dropout=0.3, **SHAPES[shape])
    model = {"decoder": tformer.Decoder, "encoder-decoder": tformer.EncoderDecoder}.get(
        cfg.kind, lambda c: tformer.EncoderClassifier(c, 3))(cfg)
    return model.train()


def loss_of(model, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 12), generator=g)
    torch.manual_seed(seed)                                     # the dropout masks
    if model.kind == "decoder":
        return model(ids, labels=ids.roll(-1, 1))
    if model.kind == "encoder-decoder":
        logits = model(ids, ids[:, :8])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:9].flatten())
    return torch.nn.functional.cross_entropy(model(ids), ids[:, 0] % 3)


def grads(model, checkpointed: bool) -> tuple[float, dict[str, torch.Tensor]]:
    checkpoint_activations(model, checkpointed)
    model.zero_grad(set_to_none=True)
    loss = loss_of(model)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def saved_bytes(model) -> int:
    """Bytes of the tensors autograd keeps for the backward of one training forward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss_of(model)
    return total


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_same_gradients_with_dropout_and_less_kept(shape):
    model = build(shape)
    plain_loss, plain = grads(model, False)
    kept_plain = saved_bytes(model)
    loss, ours = grads(model, True)
    assert loss == plain_loss
    assert ours.keys() == plain.keys() and len(ours) > 0
    for name, g in plain.items():
        torch.testing.assert_close(ours[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert saved_bytes(model) < 0.5 * kept_plain                 # each layer keeps its inputs only


def test_lora_on_an_int8_base_trains_the_same_adapters():
    model = build("llama")
    quantize_base(model)
    apply_lora(model, r=4, alpha=8, targets=("q", "v", "down"))
    _, plain = grads(model, False)
    _, ours = grads(model, True)
    assert plain and all("lora" in name for name in plain)
    for name, g in plain.items():
        torch.testing.assert_close(ours[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_evaluation_and_no_grad_run_as_before():
    model = checkpoint_activations(build("gpt"))
    ids = torch.randint(0, 50, (2, 10))
    with torch.no_grad():
        checkpointed = model.eval()(ids)
        checkpoint_activations(model, False)
        assert torch.equal(checkpointed, model(ids))


def test_the_flag_reaches_the_trained_model(tmp_path):
    from tformer.cli import build_parser
    from tformer.cli.train import prepare
    from tformer.training.loop import Trainer

    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question\n" * 40)
    argv = ["train", "--data", str(text), "--preset", "tiny", "--context", "16", "--batch-size", "4",
            "--max-steps", "2", "--eval-every", "1000", "--no-progress", "--precision", "fp32",
            "--out", str(tmp_path / "run"), "--activation-checkpointing"]
    task, cfg, resume, saved, _ = prepare(build_parser().parse_args(argv))
    trainer = Trainer(task, cfg, args=saved)
    trainer.run(resume)
    layers = [m for m in trainer.plain.modules() if isinstance(m, Block)]
    assert len(layers) == trainer.plain.cfg.n_layers and all(layer.checkpointed for layer in layers)
