"""Int8 token embeddings of a frozen LoRA base (inference/int8_embedding.py, `--lora-int8`): a lookup is the
dequantised table's row exactly, a tied table is its output layer's int8 weight (one copy), and the model
still generates, trains its adapters and saves / loads as an adapter checkpoint."""

import copy

import torch

import tformer
from tformer.inference.int8_embedding import Int8Embedding, quantize_base
from tformer.inference.quant import Int8Linear, quantize_int8, quantize_weight
from tformer.model.lora import apply_lora


def tiny(kind: str = "decoder", **overrides):
    torch.manual_seed(0)
    cfg = tformer.preset("tiny", vocab_size=97, max_seq_len=64, **overrides)
    return (tformer.Decoder(cfg) if kind == "decoder" else tformer.EncoderDecoder(cfg)).eval()


def test_a_lookup_is_the_dequantised_tables_row_exactly():
    torch.manual_seed(1)
    table = torch.nn.Embedding(50, 24)
    q, scales = quantize_weight(table.weight)
    emb = Int8Embedding(q, scales)
    ids = torch.randint(0, 50, (3, 7))
    dequantised = q.float() * scales[:, None]                               # s_t · q_t, every row
    got = emb(ids)
    assert got.shape == (3, 7, 24) and torch.equal(got, dequantised[ids])
    # rounding moves each value by at most half a step of its row: |e - E| <= s_t / 2
    error = (got - table.weight[ids]).abs().detach()
    assert torch.all(error <= scales[ids][..., None] / 2 * (1 + 1e-6))


def test_a_tied_table_is_its_output_layers_int8_weight():
    model = tiny()
    assert model.cfg.tie_embeddings
    want_q, want_s = quantize_weight(model.stack.embed.token.weight)
    quantize_base(model)
    token, head = model.stack.embed.token, model.lm_head
    assert isinstance(token, Int8Embedding) and isinstance(head, Int8Linear)
    assert token.weight is head.weight and token.scales is head.scales            # one int8 copy
    assert torch.equal(token.weight, want_q) and torch.equal(token.scales, want_s)
    assert not any(p.dtype == torch.float32 and p.shape == (97, model.cfg.d_model) for p in model.parameters())


def test_an_untied_table_gets_its_own_int8_rows():
    model = tiny(tie_embeddings=False)
    fp32 = model.stack.embed.token.weight.detach().clone()
    quantize_base(model)
    token = model.stack.embed.token
    assert isinstance(token, Int8Embedding) and token.weight is not model.lm_head.weight
    q, s = quantize_weight(fp32)
    assert torch.equal(token.weight, q) and torch.equal(token.scales, s)


def test_an_encoder_decoders_shared_table_is_replaced_wherever_it_is_held():
    model = quantize_base(tiny("encoder-decoder"))
    shared = model.shared
    assert isinstance(shared, Int8Embedding)
    assert model.encoder.embed.token is shared and model.decoder.embed.token is shared
    src, tgt = torch.randint(3, 97, (2, 6)), torch.randint(3, 97, (2, 5))
    with torch.inference_mode():
        assert model(src, tgt).shape == (2, 5, 97)


def test_the_int8_table_model_generates_as_the_int8_model_with_those_rows():
    """The model with int8 tables computes what the int8 model (quantize_int8) computes once its fp32 table
    holds the dequantised rows: generation, cached and uncached, reads the tables through the lookup."""
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    model = quantize_base(tiny())
    twin = quantize_int8(tiny())
    with torch.no_grad():
        token = model.stack.embed.token
        twin.stack.embed.token.weight.copy_(token.weight.float() * token.scales[:, None])
        torch.testing.assert_close(model(ids), twin(ids), rtol=0, atol=0)
        cached = model.generate(ids, max_new_tokens=8, eos_token_id=[])
        uncached = model.generate(ids, max_new_tokens=8, eos_token_id=[], use_cache=False)
    assert torch.equal(cached, uncached) and torch.equal(cached, twin.generate(ids, max_new_tokens=8, eos_token_id=[]))
    assert model.new_cache(1, 8).layers[0].k.dtype == torch.float32


def test_an_adapter_on_the_int8_base_saves_and_loads_back(tmp_path):
    base = tiny()
    tformer.save(base, tmp_path / "base")
    model = apply_lora(quantize_base(copy.deepcopy(base)), r=2, alpha=4, targets=("qkv",)).train()
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(0, 97, (2, 9))
    model(ids, labels=ids).backward()                                      # trains through the int8 table
    assert {n for n, p in model.named_parameters() if p.grad is not None} == {
        n for n, p in model.named_parameters() if p.requires_grad}
    tformer.save(model, tmp_path / "adapter", adapter_base=tmp_path / "base")
    loaded = tformer.load(tmp_path / "adapter")
    assert isinstance(loaded.stack.embed.token, Int8Embedding)
    assert loaded.stack.embed.token.weight is loaded.lm_head.weight
    with torch.no_grad():
        assert torch.equal(loaded(ids), model.eval()(ids))
