"""Training through an imported model equals training Hugging Face's: for GPT-2, Llama (GQA), BERT,
Marian, BART and T5, the gradient of one loss of the padded outputs, backpropagated through tformer's
import, equals the gradient of the same loss through the HF model, parameter by parameter (tformer's
gradients written under HF's names by the export's own key map, as `to_hf` writes weights: fused
q/k/v split, GPT-2's Conv1D transposed, Llama's rotary layout). The forward tests (test_hf_*.py) check
the values a model computes; this checks what a training step changes."""

import copy

import pytest
import torch

import tformer
from hf_util import batch, save_hf, transformers
from tformer.checkpoints.hf import export_layout, hf_state_dict

CASES = {
    "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=61, n_embd=24, n_head=3, n_layer=2, n_positions=48, bos_token_id=None, eos_token_id=None)),
    "llama-gqa": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=61, hidden_size=24, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=40, max_position_embeddings=48, bos_token_id=None, eos_token_id=None, pad_token_id=0)),
    "bert": (transformers.BertModel, transformers.BertConfig(
        vocab_size=61, hidden_size=24, num_attention_heads=3, num_hidden_layers=2, intermediate_size=40,
        max_position_embeddings=32)),
    "marian": (transformers.MarianMTModel, transformers.MarianConfig(
        vocab_size=61, d_model=24, encoder_attention_heads=3, decoder_attention_heads=3, encoder_layers=2,
        decoder_layers=1, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=64, scale_embedding=True,
        pad_token_id=60, decoder_start_token_id=60, eos_token_id=None, forced_eos_token_id=None)),
    "bart": (transformers.BartForConditionalGeneration, transformers.BartConfig(
        vocab_size=61, d_model=32, encoder_attention_heads=4, decoder_attention_heads=8, encoder_layers=2,
        decoder_layers=3, encoder_ffn_dim=40, decoder_ffn_dim=56, max_position_embeddings=64, eos_token_id=None,
        forced_eos_token_id=None)),
    "t5": (transformers.T5ForConditionalGeneration, transformers.T5Config(
        vocab_size=47, d_model=24, d_kv=4, d_ff=28, num_layers=3, num_decoder_layers=1, num_heads=5,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, relative_attention_num_buckets=10,
        relative_attention_max_distance=16, eos_token_id=None, decoder_start_token_id=0, pad_token_id=0)),
}


def outputs(model, hf: bool, kind: str, vocab: int):
    """The model's padded outputs (logits; BERT: hidden states) on fixed batches, and the target mask."""
    src, src_mask = batch(vocab, 3, 9, seed=4)
    tgt, tgt_mask = batch(vocab, 3, 7, seed=5)
    if kind == "encoder-decoder":
        if hf:
            out = model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
            return out.logits, tgt_mask
        return model(src, tgt, src_mask, tgt_mask), tgt_mask
    if hf:
        out = model(input_ids=src, attention_mask=src_mask)
        return (out.logits if kind == "decoder" else out.last_hidden_state), src_mask
    return model(src, src_mask), src_mask


def backward(model, hf: bool, kind: str, vocab: int) -> None:
    """A loss with a different weight on every real output (a fixed random projection), backpropagated."""
    y, mask = outputs(model, hf, kind, vocab)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y * weights)[mask.bool()].sum().backward()


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_equal_hf(name, tmp_path):
    model_cls, config = CASES[name]
    hf = save_hf(model_cls(config), tmp_path, seed=30, share_embeddings=name in ("marian", "bart"))
    ours = tformer.from_hf(tmp_path)
    kind, vocab = ours.cfg.kind, ours.cfg.vocab_size
    hf.eval()                                     # no dropout: the same function on both sides
    ours.eval()
    backward(hf, True, kind, vocab)
    backward(ours, False, kind, vocab)

    grads = copy.deepcopy(ours)                   # tformer's gradients in place of its weights ...
    with torch.no_grad():
        for (_, g), (_, p) in zip(grads.named_parameters(), ours.named_parameters(), strict=True):
            g.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    family, state = hf_state_dict(grads)          # ... under HF's names, through the export's key map
    _, prefix, heads = export_layout(family, grads)
    ours_by_hf = {(k if k in heads else prefix + k): v for k, v in state.items()}

    compared = 0
    for key, p in hf.named_parameters():
        if p.grad is None or not p.requires_grad:
            continue
        assert key in ours_by_hf, f"{key}: HF trains it, tformer's export has no tensor for it"
        scale = p.grad.abs().max().item()         # T5's unscaled scores make some gradients large
        torch.testing.assert_close(ours_by_hf[key], p.grad, rtol=1e-4, atol=1e-5 * max(scale, 1.0),
                                   msg=lambda m, k=key: f"{k}: {m}")
        compared += 1
    assert compared >= 10                         # every layer's matrices, not a handful
