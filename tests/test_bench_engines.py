"""The CTranslate2 / ONNX Runtime peers of `tformer bench`: converted with their own tools from the
same weights, they compute what tformer computes (greedy tokens, beam-4 output, hidden states),
and a missing peer is reported, not an error. Tiny random models: seconds, no downloads."""

import importlib.util
from pathlib import Path

import pytest
import torch

from tformer.bench import engines, onnx_peer
from tformer.bench.common import PeerProcess, from_hf_model, hf_gpt2, pad_rows, peer_threads

needs_ct2 = pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None, reason="ctranslate2 not installed")
needs_ort = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("onnxruntime", "onnx")),
                               reason="onnxruntime / onnx not installed")


def test_missing_peers_are_reported_and_skipped(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in engines.PEERS else real(name, *a))
    assert engines.missing_peers() == list(engines.PEERS)
    assert "pip install 'tformer[bench]'" in engines.missing_note()
    assert engines.run("cpu", quick=True, ceilings={}) == []


def test_cli_offers_the_engines_bench():
    from tformer.bench import BENCHES
    from tformer.cli.bench import NAMES
    assert "engines" in NAMES and "engines" in BENCHES


@needs_ct2
def test_ctranslate2_greedy_tokens_equal_tformer_from_the_same_weights(tmp_path: Path):
    import ctranslate2
    ours = from_hf_model(hf_gpt2(2, 64, 4, 97, 64)).eval()
    eos = {0: "<|endoftext|>"}
    hf_dir = engines.hf_directory(ours, tmp_path, eos, {"bos_token": eos[0], "eos_token": eos[0], "unk_token": eos[0]})
    paths = engines.ct2_models(hf_dir, str(tmp_path))
    ids = torch.randint(1, 97, (3, 7), generator=torch.Generator().manual_seed(0))
    want = ours.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])[:, 7:]
    got = engines.ct2_greedy(ctranslate2.Generator(paths["fp32"], device="cpu", intra_threads=peer_threads()),
                             ids.tolist(), 12)
    assert torch.equal(torch.tensor(got), want)
    int8 = engines.ct2_greedy(ctranslate2.Generator(paths["int8"], device="cpu", compute_type="int8"), ids.tolist(), 12)
    assert torch.tensor(int8).shape == want.shape


@needs_ct2
def test_ctranslate2_in_its_own_process_computes_what_it_computes_here(tmp_path: Path):
    """The bench runs CTranslate2 in a child process (PeerProcess): same tokens as tformer, and a
    failure in the child is raised here with its message."""
    ours = from_hf_model(hf_gpt2(2, 64, 4, 97, 64)).eval()
    eos = {0: "<|endoftext|>"}
    hf_dir = engines.hf_directory(ours, tmp_path, eos, {"bos_token": eos[0], "eos_token": eos[0], "unk_token": eos[0]})
    ids = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(3))
    want = ours.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[])[:, 5:]
    paths = engines.ct2_models(hf_dir, str(tmp_path))
    with PeerProcess(engines.ct2_peer, "generator", paths["fp32"], "fp32", 1) as peer:
        assert torch.equal(torch.tensor(peer(ids.tolist(), 8)), want)
        assert torch.equal(torch.tensor(peer(ids[:1].tolist(), 8)), want[:1])      # the child serves many calls
        with pytest.raises(RuntimeError, match="peer process: TypeError"):
            peer(None, 8)
    with pytest.raises(RuntimeError, match="peer process: .*no-such-dir"):
        PeerProcess(engines.ct2_peer, "generator", str(tmp_path / "no-such-dir"), "fp32", 1)


@needs_ct2
def test_ctranslate2_beam_search_equals_tformer_and_hf_on_a_marian_model(tmp_path: Path):
    import ctranslate2
    from transformers import MarianConfig, MarianMTModel
    shape = dict(engines.MARIAN, vocab_size=101, d_model=32, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                 pad_token_id=100, decoder_start_token_id=100)
    torch.manual_seed(0)
    hf = MarianMTModel(MarianConfig(**shape)).eval()
    ours = from_hf_model(hf).eval()
    names = {0: "</s>", 1: "<unk>", 100: "<pad>"}
    special = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    paths = engines.ct2_models(engines.hf_directory(ours, tmp_path, names, special), str(tmp_path))
    g = torch.Generator().manual_seed(1)
    sources = [torch.randint(2, 100, (k,), generator=g).tolist() + [0] for k in (5, 9, 7)]
    ids, mask = pad_rows(sources, 100)
    ours_out = [s[1:].tolist() for s in ours.generate(ids, attention_mask=mask, num_beams=4, max_new_tokens=6,
                                                       eos_token_id=[])]
    name_of = engines.numbered_tokenizer(101, names).id_to_token
    peer = engines.ct2_beam(ctranslate2.Translator(paths["fp32"], device="cpu"),
                            [[name_of(i) for i in s] for s in sources], 6, 16)
    assert [[name_of(i) for i in s] for s in ours_out] == peer
    assert engines.same_as_hf_beam(hf, sources, ours_out, 100, 6)


@needs_ort
def test_onnx_export_and_int8_quantisation_compute_the_hf_encoder(tmp_path: Path):
    import onnxruntime as ort
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    hf = BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=64)).eval()
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    paths = onnx_peer.to_onnx(hf, tmp_path)
    assert not hf.training
    inputs = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": torch.zeros_like(ids).numpy()}
    for name, tol in (("fp32", 1e-4), ("int8", 0.2)):
        session = ort.InferenceSession(paths[name], providers=["CPUExecutionProvider"])
        got = torch.from_numpy(session.run(None, inputs)[0])
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=tol, rtol=tol)   # other shapes than the export's
