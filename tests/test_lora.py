"""LoRA (tformer.model.lora) and its peft format (tformer.checkpoints.hf.lora), against peft itself on
tiny random GPT-2, Llama (grouped-query attention, rsLoRA), BERT, T5 v1.1 (gated FFN, cross-attention)
and BART models: an adapter peft saved gives peft's outputs in tformer; an adapter tformer saved gives
tformer's outputs in peft; peft's merge_and_unload equals tformer's merge exported with to_hf; merged
equals unmerged; only the adapters train; greedy generation (decoding plans, the fused GPT step)
does not skip an unmerged adapter."""

import json

import pytest
import torch
from safetensors.torch import load_file

import tformer
from hf_util import batch, save_hf, transformers
from tformer.checkpoints.hf.lora import from_peft, to_peft
from tformer.errors import ConfigError
from tformer.model.linear import Plan
from tformer.model.lora import (
    LoRALinear,
    apply_lora,
    load_lora_state_dict,
    lora_state_dict,
    merge,
    remove_lora,
    unmerge,
)
from tformer.model.plans import plan_decoding

peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.filterwarnings(f"ignore:{m}:UserWarning") for m in (   # peft's expected notes
    "fan_in_fan_out is set",                     # GPT-2: its lm_head is a Linear, its c_attn a Conv1D
    "Setting `save_embedding_layers`",           # an adapted lm_head is saved with its base weight
    "Model has `tie_word_embeddings=True`")]     # an adapter on a tied lm_head
TOL = 1e-5                   # fp32, on outputs of magnitude ~1-10

# family: (HF config, HF model, config kwargs, peft's target_modules, peft extras, tformer's targets, tformer extras)
FAMILIES = {
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
             dict(vocab_size=61, n_embd=24, n_head=3, n_layer=2, n_positions=48, tie_word_embeddings=False),
             ["c_attn", "c_proj", "c_fc", "lm_head"], dict(fan_in_fan_out=True),
             ("q", "v", "o", "up", "lm_head"), {}),        # q and v -> one c_attn adapter of rank 2r
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(vocab_size=61, hidden_size=24, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
                   intermediate_size=40, max_position_embeddings=48),
              ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
              dict(use_rslora=True), ("qkv", "o", "gate", "down", "lm_head"), dict(rslora=True)),
    "bert": (transformers.BertConfig, transformers.BertModel,
             dict(vocab_size=61, hidden_size=24, num_attention_heads=3, num_hidden_layers=2, intermediate_size=40,
                  max_position_embeddings=32),
             ["query", "key", "value", "output.dense", "intermediate.dense"], {},
             ("q", "k", "v", "o", "up", "down"), {}),
    "t5": (transformers.T5Config, transformers.T5ForConditionalGeneration,
           dict(vocab_size=47, d_model=24, d_kv=4, d_ff=28, num_layers=2, num_decoder_layers=1, num_heads=5,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False, relative_attention_num_buckets=10,
                relative_attention_max_distance=16, eos_token_id=None, decoder_start_token_id=0, pad_token_id=0),
           ["q", "k", "v", "o", "wi_0", "wi_1", "wo", "lm_head"], {}, ("q", "v", "o", "gate", "up", "down"), {}),
    "bart": (transformers.BartConfig, transformers.BartForConditionalGeneration,
             dict(vocab_size=61, d_model=24, encoder_attention_heads=3, decoder_attention_heads=3, encoder_layers=2,
                  decoder_layers=1, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=64,
                  eos_token_id=None, forced_eos_token_id=None),
             ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], {}, ("q", "k", "v", "o", "up", "down"), {}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, directory of a random HF model, HF model class)."""
    config_cls, model_cls, kw, *_ = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_hf(model_cls(config_cls(**kw)), path, seed=len(request.param))
    return request.param, path, model_cls


def load_hf(model_cls, path):
    extra = dict(add_pooling_layer=False) if model_cls is transformers.BertModel else {}
    return model_cls.from_pretrained(path, **extra).eval()


def randomize(params, seed: int, std: float = 0.1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(std * torch.randn(p.shape, generator=gen))


def inputs(model):
    vocab = model.cfg.vocab_size
    ids, mask = batch(vocab, 2, 9, seed=3)
    tgt, _ = batch(vocab, 2, 6, seed=4)
    return ids, mask, tgt


def ours_out(model, ids, mask, tgt):
    with torch.no_grad():
        if model.kind == "decoder":
            return model(ids)
        if model.kind == "encoder":
            return model(ids, mask)[mask.bool()]           # padded positions are free to differ
        return model(ids, tgt, mask)


def hf_out(model, ids, mask, tgt, kind):
    with torch.no_grad():
        if kind == "decoder":
            return model(input_ids=ids).logits
        if kind == "encoder":
            return model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=tgt).logits


def diff(a, b) -> float:
    return (a - b).abs().max().item()


def ours_with_adapters(name, path, seed=7):
    *_, targets, extra = FAMILIES[name]
    model = apply_lora(tformer.from_hf(path), r=2, alpha=6, targets=targets, **extra)
    randomize(lora_state_dict(model).values(), seed)
    return model


def test_peft_adapter_loads_into_tformer_with_peft_outputs(family, tmp_path):
    name, path, model_cls = family
    _, _, _, peft_targets, peft_extra, _, _ = FAMILIES[name]
    hf = peft.get_peft_model(load_hf(model_cls, path), peft.LoraConfig(r=4, lora_alpha=8, target_modules=peft_targets,
                                                                        **peft_extra)).eval()
    randomize([p for n, p in hf.named_parameters() if "lora_" in n], seed=5)
    hf.save_pretrained(tmp_path / "adapter")
    ours = from_peft(tformer.from_hf(path), tmp_path / "adapter")
    ids, mask, tgt = inputs(ours)
    assert diff(ours_out(ours, ids, mask, tgt), hf_out(hf, ids, mask, tgt, ours.kind)) <= TOL
    base = tformer.from_hf(path)
    assert diff(ours_out(ours, ids, mask, tgt), ours_out(base, ids, mask, tgt)) > 1e-2   # the adapter counts


def test_tformer_adapter_loads_into_peft_with_tformer_outputs(family, tmp_path):
    name, path, model_cls = family
    ours = ours_with_adapters(name, path)
    out = to_peft(ours, tmp_path / "adapter", base_model_name_or_path=str(path))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == str(path)
    hf = peft.PeftModel.from_pretrained(load_hf(model_cls, path), out).eval()
    ids, mask, tgt = inputs(ours)
    assert diff(ours_out(ours, ids, mask, tgt), hf_out(hf, ids, mask, tgt, ours.kind)) <= TOL
    # and back: from_peft(to_peft(m)) computes what m does
    again = from_peft(tformer.from_hf(path), out)
    assert diff(ours_out(again, ids, mask, tgt), ours_out(ours, ids, mask, tgt)) <= TOL


def test_gpt2_q_and_v_adapters_become_one_c_attn_adapter(tmp_path):
    """peft's GPT-2 adapter covers the fused c_attn: tformer's separate q and v adapters are written as
    one of rank 2r, its B zero on the k rows; the o-only adapter is named so it misses mlp.c_proj."""
    path = tmp_path / "gpt2"
    config_cls, model_cls, kw, *_ = FAMILIES["gpt2"]
    save_hf(model_cls(config_cls(**kw)), path)
    ours = apply_lora(tformer.from_hf(path), r=2, alpha=6, targets=("q", "v", "o"))
    randomize(lora_state_dict(ours).values(), seed=1)
    out = to_peft(ours, tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    state = load_file(out / "adapter_model.safetensors")
    assert state["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"].shape == (72, 4)
    assert not state["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"][24:48].any()
    assert sorted(config["target_modules"]) == ["attn.c_proj", "c_attn"] and config["fan_in_fan_out"] is True
    ranks = {m: config["rank_pattern"].get(f"transformer.h.0.{m}", config["r"]) for m in ("attn.c_attn", "attn.c_proj")}
    assert ranks == {"attn.c_attn": 4, "attn.c_proj": 2}
    assert len(state) == 2 * 2 * 2                      # 2 layers x (c_attn, c_proj) x (A, B), nothing else


def test_an_adapter_on_a_tied_output_layer_goes_through_peft_unmerged(tmp_path):
    """GPT-2 ties lm_head to the token embedding: peft saves the head's base weight with its adapter
    (checked against the model on import); merging would change the embedding too, and is refused."""
    path = tmp_path / "gpt2"
    config_cls, model_cls, kw, *_ = FAMILIES["gpt2"]
    save_hf(model_cls(config_cls(**{**kw, "tie_word_embeddings": True})), path)
    ours = apply_lora(tformer.from_hf(path), r=2, alpha=4, targets=("qkv", "lm_head"))
    randomize(lora_state_dict(ours).values(), seed=6)
    out = to_peft(ours, tmp_path / "adapter")
    assert "base_model.model.lm_head.base_layer.weight" in load_file(out / "adapter_model.safetensors")
    hf = peft.PeftModel.from_pretrained(load_hf(model_cls, path), out).eval()
    ids, mask, tgt = inputs(ours)
    assert diff(ours_out(ours, ids, mask, tgt), hf_out(hf, ids, mask, tgt, "decoder")) <= TOL
    again = from_peft(tformer.from_hf(path), out)
    assert diff(ours_out(again, ids, mask, tgt), ours_out(ours, ids, mask, tgt)) <= TOL
    with pytest.raises(ConfigError, match="weight of lm_head is shared"):
        merge(again)
    other = tformer.from_hf(path)
    with torch.no_grad():
        other.lm_head.weight.add_(1.0)
    with pytest.raises(ConfigError, match="lm_head.base_layer.weight differs"):
        from_peft(other, out)


def test_a_tagger_head_adapter_goes_through_peft(tmp_path):
    """BertForTokenClassification <-> EncoderTokenClassifier: the label layer is HF's `classifier`."""
    cfg = transformers.BertConfig(**FAMILIES["bert"][2], num_labels=5)
    save_hf(transformers.BertForTokenClassification(cfg), tmp_path / "m")
    ours = apply_lora(tformer.from_hf(tmp_path / "m"), r=2, alpha=4, targets=("q", "v", "head"))
    assert ours.kind == "tagger"
    randomize(lora_state_dict(ours).values(), seed=1)
    out = to_peft(ours, tmp_path / "a")
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == ["classifier", "query", "value"]
    theirs = peft.PeftModel.from_pretrained(load_hf(transformers.BertForTokenClassification, tmp_path / "m"), out)
    ids, mask = batch(61, 2, 9, seed=3)
    real = mask.bool()                                       # padded positions are free to differ
    with torch.no_grad():
        expected = ours(ids, mask)[real]
        assert diff(theirs.eval()(input_ids=ids, attention_mask=mask).logits[real], expected) <= TOL
        assert diff(from_peft(tformer.from_hf(tmp_path / "m"), out)(ids, mask)[real], expected) <= TOL


def test_merged_equals_unmerged(family):
    name, path, _ = family
    ours = ours_with_adapters(name, path)
    ids, mask, tgt = inputs(ours)
    unmerged = ours_out(ours, ids, mask, tgt)
    merge(ours)
    assert all(layer.merged for layer in ours.modules() if isinstance(layer, LoRALinear))
    assert diff(ours_out(ours, ids, mask, tgt), unmerged) <= TOL
    unmerge(ours)
    assert diff(ours_out(ours, ids, mask, tgt), unmerged) <= TOL


def test_peft_merge_and_unload_equals_tformer_merge_exported(family, tmp_path):
    name, path, model_cls = family
    ours = ours_with_adapters(name, path)
    adapter = to_peft(ours, tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(load_hf(model_cls, path), adapter).merge_and_unload().state_dict()
    exported = load_hf(model_cls, tformer.to_hf(remove_lora(merge(ours)), tmp_path / "merged")).state_dict()
    assert not any(isinstance(m, LoRALinear) for m in ours.modules())
    adapted = {k.removeprefix("base_model.model.").replace("lora_A.", "")
               for k in load_file(adapter / "adapter_model.safetensors") if "lora_A" in k}
    assert adapted and adapted <= set(exported) and adapted <= set(theirs)
    base = load_hf(model_cls, path).state_dict()
    for k in adapted:
        assert not torch.equal(base[k], theirs[k])                       # merging changed it ...
    worst = max(diff(exported[k], theirs[k]) for k in set(exported) & set(theirs))
    assert worst <= 1e-6                                                 # ... to the same weights


def test_only_adapters_train(family):
    name, path, _ = family
    ours = ours_with_adapters(name, path).train()
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(ours))
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    ids, mask, tgt = inputs(ours)
    out = ours(ids) if ours.kind == "decoder" else ours(ids, mask) if ours.kind == "encoder" else ours(ids, tgt, mask)
    out.square().mean().backward()
    opt.step()
    changed = {k for k, v in ours.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == trainable


def test_state_dict_round_trip_and_remove_lora(tmp_path):
    path = tmp_path / "llama"
    config_cls, model_cls, kw, *_ = FAMILIES["llama"]
    save_hf(model_cls(config_cls(**kw)), path)
    ours = ours_with_adapters("llama", path)
    other = apply_lora(tformer.from_hf(path), r=2, alpha=6, targets=FAMILIES["llama"][5], rslora=True)
    load_lora_state_dict(other, lora_state_dict(ours))
    ids = torch.randint(0, 61, (2, 7))
    assert torch.equal(ours_out(other, ids, None, None), ours_out(ours, ids, None, None))
    base = tformer.from_hf(path)
    assert torch.equal(ours_out(remove_lora(other), ids, None, None), ours_out(base, ids, None, None))
    assert type(other.lm_head).__name__ == "Linear" and other.state_dict().keys() == base.state_dict().keys()
    with pytest.raises(ConfigError, match="missing"):
        load_lora_state_dict(ours, {})


@pytest.mark.parametrize("kind", ["classifier", "tagger", "encoder-decoder"])
def test_every_model_kind_takes_adapters(kind):
    cfg = tformer.ModelConfig(kind="encoder-decoder" if kind == "encoder-decoder" else "encoder", vocab_size=40,
                              d_model=16, n_heads=2, n_layers=2, activation="swiglu", tie_embeddings=False)
    model = {"classifier": lambda: tformer.EncoderClassifier(cfg, 3), "tagger": lambda: tformer.EncoderTokenClassifier(
        cfg, 3), "encoder-decoder": lambda: tformer.EncoderDecoder(cfg)}[kind]().eval()
    head = "lm_head" if kind == "encoder-decoder" else "head"
    apply_lora(model, r=3, alpha=3, targets=("q", "k", "v", "o", "gate", "up", "down", head))
    randomize(lora_state_dict(model).values(), seed=2, std=0.3)
    if kind == "encoder-decoder":                                     # cross-attention: q_proj, kv_proj adapted
        assert set(model.decoder.layers[0].cross_attn.kv_proj.lora) == {"k", "v"}
    ids = torch.randint(0, 40, (2, 6))
    run = (lambda: model(ids, ids[:, :4])) if kind == "encoder-decoder" else (lambda: model(ids))
    with torch.no_grad():
        unmerged = run()
        merge(model)
        assert diff(run(), unmerged) <= TOL


GENERATORS = {   # big enough for decoding plans (linear.SPLIT_MIN weights); the first fits the fused GPT step
    "gpt": dict(kind="decoder", vocab_size=300, d_model=256, n_heads=4, n_layers=2, d_ff=1024, activation="gelu",
                max_seq_len=64, tie_embeddings=False),
    "llama": dict(kind="decoder", vocab_size=300, d_model=256, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=512,
                  activation="swiglu", positional="rope", norm="rmsnorm", bias=False, max_seq_len=64,
                  tie_embeddings=False),
    "seq2seq": dict(kind="encoder-decoder", vocab_size=300, d_model=256, n_heads=4, n_layers=1, d_ff=512,
                    activation="relu", max_seq_len=64, tie_embeddings=False, decoder_start_token_id=0),
}


@pytest.mark.parametrize("shape", list(GENERATORS))
def test_generate_with_an_unmerged_adapter_equals_the_merged_model(shape):
    """Greedy decoding runs the decoding plans (linear.py), the argmax screen of the output layer and,
    for the GPT shape, the fused step (inference/fused.py): none may skip an unmerged adapter."""
    cfg = tformer.ModelConfig(**GENERATORS[shape])
    model = (tformer.EncoderDecoder if cfg.kind == "encoder-decoder" else tformer.Decoder)(cfg).eval()
    randomize([p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2], seed=3, std=0.05)
    prompt = torch.randint(1, 300, (2, 5), generator=torch.Generator().manual_seed(0))

    def generate():
        return model.generate(prompt, max_new_tokens=12, eos_token_id=[])

    base = generate()
    apply_lora(model, r=4, alpha=8, targets=("q", "k", "v", "o", "up", "down", "lm_head"))
    randomize(lora_state_dict(model).values(), seed=4, std=0.05)
    unmerged = generate()
    head = model.lm_head
    assert head.plan is None and isinstance(head.base_plan, Plan)           # the base still runs on its plan
    merge(model)
    merged = generate()
    assert isinstance(head.plan, Plan)                                       # planned again for the merged W
    assert torch.equal(unmerged, merged)
    assert not torch.equal(unmerged, base)                                   # the adapter changes the tokens
    unmerge(model)
    assert plan_decoding(model, 2) > 0 and torch.equal(generate(), unmerged)


@pytest.mark.parametrize("kwargs, named", [
    (dict(r=0), "rank r=0"), (dict(r=-2), "rank r=-2"), (dict(r=1.5), "rank r=1.5"),
    (dict(alpha=0), "alpha=0"), (dict(dropout=1.0), "dropout=1.0"),
    (dict(targets=("q", "query")), "query"), (dict(targets=("gate",)), "gate.*no layer"),
])
def test_bad_settings_are_one_line_config_errors(kwargs, named):
    model = tformer.Decoder(tformer.ModelConfig(kind="decoder", vocab_size=40, d_model=16, n_heads=2, n_layers=1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=named) as e:
        apply_lora(model, **{"r": 4, "alpha": 8, **kwargs})
    assert "\n" not in str(e.value)
    assert not any(isinstance(m, LoRALinear) for m in model.modules()) and model.state_dict().keys() == before.keys()


def test_refusals_name_what(tmp_path):
    config_cls, model_cls, kw, *_ = FAMILIES["gpt2"]
    save_hf(model_cls(config_cls(**kw)), tmp_path / "gpt2")
    adapter = to_peft(ours_with_adapters("gpt2", tmp_path / "gpt2"), tmp_path / "adapter")
    llama_cls, llama_model, llama_kw, *_ = FAMILIES["llama"]
    save_hf(llama_model(llama_cls(**llama_kw)), tmp_path / "llama")
    llama = tformer.from_hf(tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"transformer\.h\.0\.attn\..*names no LoRA weight") as e:
        from_peft(llama, adapter)                                   # a GPT-2 adapter on a Llama model
    assert "\n" not in str(e.value) and not any(isinstance(m, LoRALinear) for m in llama.modules())
    config = json.loads((adapter / "adapter_config.json").read_text())
    for change in (dict(use_dora=True), dict(modules_to_save=["lm_head"]), dict(bias="all")):
        (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=f"{next(iter(change))}=.*not supported"):
            from_peft(tformer.from_hf(tmp_path / "gpt2"), adapter)
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 3}))
    with pytest.raises(ConfigError, match="r=3"):
        from_peft(tformer.from_hf(tmp_path / "gpt2"), adapter)
    llama = tformer.from_hf(tmp_path / "llama")       # a layer neither Linear nor int8 (QLoRA: test_lora_train)
    llama.stack.layers[0].attn.qkv_proj = torch.nn.Identity()
    with pytest.raises(ConfigError, match="Identity, neither a Linear"):
        apply_lora(llama, r=2, alpha=2)


def test_nothing_drops_an_unmerged_adapter_without_a_word(tmp_path):
    """save, to_hf / to_gguf (through hf_state_dict) and quantize_int8 would keep W and lose the adapters:
    each refuses with a one-line error and writes nothing; once merged, the export and int8 carry them."""
    from tformer.checkpoints.hf import to_hf
    from tformer.inference.quant import quantize_int8

    cfg = tformer.ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, max_seq_len=32)
    model = apply_lora(tformer.Decoder(cfg).eval(), r=2, alpha=4, targets=("q", "v"))
    for layer in model.modules():
        if isinstance(layer, LoRALinear):
            for adapter in layer.lora.values():
                torch.nn.init.normal_(adapter.b)
    for call in (lambda: tformer.save(model, tmp_path / "ckpt"), lambda: to_hf(model, tmp_path / "hf"),
                 lambda: quantize_int8(model)):
        with pytest.raises(ConfigError, match="LoRA adapters") as e:
            call()
        assert "\n" not in str(e.value)
    assert not list(tmp_path.iterdir()) and any(isinstance(m, LoRALinear) for m in model.modules())
    ids = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        want = model(ids)
        merge(model)
        to_hf(model, tmp_path / "hf")
        got = tformer.from_hf(tmp_path / "hf").eval()(ids)
    assert torch.allclose(got, want, atol=TOL)


def test_an_adapter_over_every_row_trains_on_a_frozen_base():
    """`qkv` adds into every row of the first layer's projection, whose base output tracks no gradient
    (frozen embeddings and weights): the adapter's sum must still reach autograd (it once failed in place)."""
    cfg = tformer.ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, max_seq_len=32)
    model = apply_lora(tformer.Decoder(cfg).train(), r=2, alpha=4, targets=("qkv", "o"))
    ids = torch.randint(0, 50, (2, 9))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1)).backward()
    trained = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(g is not None for g in trained.values())
    assert any(g.abs().sum() > 0 for n, g in trained.items() if n.endswith(".b"))
