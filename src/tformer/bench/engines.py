"""tformer vs the inference engines a user who needs CPU speed would pick: CTranslate2 (decoding,
translation) and ONNX Runtime (sentence embeddings). Same weights, each peer converted with its
own tools:

    GPT-2 / Marian   tformer model -> `tformer.to_hf` directory -> CTranslate2's TransformersConverter
                     (quantization "float32" or "int8")
    MiniLM           the shipped HF model -> `torch.onnx.export` -> ONNX Runtime (fp32), and ONNX
                     Runtime's `quantize_dynamic` (int8 weights, int8 activations) for the int8 row

tformer's int8 rows are `quantize_int8` on the fp32 model. Peers run with as many threads as torch
(`--threads`). Timing: interleaved, warmed-up runs, medians (common.interleaved_times); CTranslate2 is
converted in one process of its own and run in another (common.PeerProcess; two threading runtimes
that have both run in one process slow each other down), called from this one between tformer's runs.
Checks: GPT-2 fp32 greedy tokens equal CTranslate2's, Marian fp32 beam-4 output equal to
CTranslate2's (and, for one batch, to HF `generate`), embeddings' cosine to the fp32 ones.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import statistics
import tempfile
from pathlib import Path
from typing import Callable

import torch

from .common import (
    PeerProcess,
    ReadProbe,
    engine_row,
    from_hf_model,
    hf_gpt2,
    interleaved_samples,
    interleaved_times,
    pad_rows,
    peer_threads,
    share_of_reads_around,
)
from .onnx_peer import minilm_rows

PEERS = ("ctranslate2", "onnxruntime", "onnx")          # the `bench` extra
GPT2 = dict(n_layers=12, d_model=768, n_heads=12, vocab=50257, n_positions=1024)
# OPUS-MT's shape (Helsinki-NLP/opus-mt-*): 6+6 post-LN layers, width 512, swish, scaled embeddings.
# init_std 0.2 (HF's default 0.02 makes a random model repeat one token): varied outputs, so that
# the equality checks mean something.
MARIAN = dict(init_std=0.2, vocab_size=32000, d_model=512, encoder_layers=6, decoder_layers=6,
              encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
              max_position_embeddings=512, activation_function="swish", scale_embedding=True, eos_token_id=0,
              pad_token_id=31999, decoder_start_token_id=31999, dropout=0.0, attention_dropout=0.0,
              activation_dropout=0.0)


def missing_peers() -> list[str]:
    return [name for name in PEERS if importlib.util.find_spec(name) is None]


def missing_note() -> str | None:
    missing = missing_peers()
    return (f"engines: {', '.join(missing)} not installed (pip install 'tformer[bench]'); "
            "the CTranslate2 / ONNX Runtime rows that need them were skipped") if missing else None


def run(device: str, quick: bool, ceilings: dict) -> list[dict]:
    if device != "cpu":
        return []                      # the peers are timed on the CPU here (their CUDA builds are separate)
    missing, rows = missing_peers(), []
    if "ctranslate2" not in missing:
        rows += gpt2_rows(quick, ceilings)
        rows += marian_rows(quick)
    if not {"onnxruntime", "onnx"} & set(missing):
        rows += minilm_rows(quick)
    return rows


# --- CTranslate2 ---------------------------------------------------------------------------------

def numbered_tokenizer(vocab: int, names: dict[int, str]):
    """A word-level tokenizer whose token i is `names[i]` or "t{i}": the converters want a vocabulary,
    and random-weight models have no real one."""
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({names.get(i, f"t{i}"): i for i in range(vocab)}, unk_token=names.get(1, "t1")))


def hf_directory(model, tmp: Path, names: dict[int, str], special: dict[str, str]) -> Path:
    """`model` written by `to_hf` into tmp/hf, with a numbered tokenizer: what CTranslate2's converter reads."""
    from ..checkpoints.hf import to_hf

    hf_dir = to_hf(model, tmp / "hf", tokenizer=numbered_tokenizer(model.cfg.vocab_size, names))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              **special}))
    return hf_dir


def ct2_convert(hf_dir: Path | str, out: Path | str, dtype: str) -> str:
    """CTranslate2's TransformersConverter: the HF directory -> a CTranslate2 model in `dtype` ("fp32", "int8")."""
    import ctranslate2

    quantization = {"fp32": "float32", "int8": "int8"}[dtype]
    return ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(out), quantization=quantization)


def ct2_converter() -> Callable:
    """For a PeerProcess of its own: the conversion runs torch (it reads the HF model), and torch having
    run in the process that then runs CTranslate2 slows CTranslate2 down (BENCHMARKS.md, "Each engine in
    its own process")."""
    return ct2_convert


def ct2_peer(kind: str, path: str, dtype: str, threads: int) -> Callable:
    """Runs in the peer process (PeerProcess): load the converted model and return the call the bench
    times, ct2_greedy ("generator") or ct2_beam ("translator") bound to it."""
    import ctranslate2

    engine, call = {"generator": (ctranslate2.Generator, ct2_greedy),
                    "translator": (ctranslate2.Translator, ct2_beam)}[kind]
    return functools.partial(call, engine(path, device="cpu", compute_type=dtype.replace("fp", "float"),
                                          intra_threads=threads))


def ct2_models(hf_dir: Path, tmp: str) -> dict[str, str]:
    """CTranslate2 models in fp32 and int8 (paths by name), converted in a process of their own."""
    with PeerProcess(ct2_converter) as convert:
        return {dtype: convert(str(hf_dir), f"{tmp}/ct2-{dtype}", dtype) for dtype in ("fp32", "int8")}


def ct2_greedy(generator, rows: list[list[int]], new: int) -> list[list[int]]:
    """Prompt ids -> their `new`-token greedy continuations by a CTranslate2 Generator over a
    numbered_tokenizer vocabulary (EOS held off until `new` tokens, as tformer's eos_token_id=[])."""
    res = generator.generate_batch([[f"t{i}" for i in row] for row in rows], max_length=new, min_length=new,
                                   sampling_topk=1, include_prompt_in_result=False)
    return [r.sequences_ids[0] for r in res]


def ct2_beam(translator, sources: list[list[str]], new: int, batch: int) -> list[list[str]]:
    """Beam-4 translations (tokens) of `sources` (tokens, ending in "</s>"), exactly `new` tokens each."""
    res = translator.translate_batch(sources, max_batch_size=batch, beam_size=4, max_decoding_length=new,
                                     min_decoding_length=new)
    return [r.hypotheses[0] for r in res]


def gpt2_rows(quick: bool, ceilings: dict) -> list[dict]:
    """Greedy decoding, 32-token prompt + 128 new tokens, batch 1 and 8, fp32 and int8."""
    from ..inference.quant import quantize_int8

    shape = dict(GPT2, n_layers=2) if quick else GPT2
    ours = from_hf_model(hf_gpt2(**shape)).eval()
    models = {"fp32": ours, "int8": quantize_int8(copy.deepcopy(ours))}
    probe = ReadProbe("cpu", 256 if quick else 1024)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        eos = {0: "<|endoftext|>"}
        hf_dir = hf_directory(ours, Path(tmp), eos, {"bos_token": eos[0], "eos_token": eos[0], "unk_token": eos[0]})
        for dtype, path in ct2_models(hf_dir, tmp).items():
            with PeerProcess(ct2_peer, "generator", path, dtype, peer_threads()) as peer:
                for batch in (1, 8):
                    rows += gpt2_case(models, dtype, batch, peer, probe, quick)
    return rows


def gpt2_case(models: dict, dtype: str, batch: int, peer: PeerProcess, probe: ReadProbe, quick: bool) -> list[dict]:
    """One GPT-2 row (and, for int8 at batch 1, the quantize_int8-vs-fp32 row)."""
    from .decode import bytes_per_token

    new, repeats = (16, 1) if quick else (128, 3)
    ids = torch.randint(1, models["fp32"].cfg.vocab_size, (batch, 32), generator=torch.Generator().manual_seed(batch))
    out = {}

    def run_ours(m=models[dtype]):
        out["ours"] = m.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=[])[:, 32:]

    def run_peer():
        out["peer"] = torch.tensor(peer(ids.tolist(), new))

    roofline = dtype == "fp32" and batch == 1
    # The roofline case samples memory right before and right after each tformer run: on a shared
    # host the read rate swings by half within seconds, so a probe seconds away measures another moment.
    fns = {"read": probe, "tformer": run_ours, "read after": probe} if roofline else {"tformer": run_ours}
    fns["peer"] = run_peer
    if dtype == "int8" and batch == 1:     # quantize_int8 on the fp32 model vs that model itself
        fns["fp32"] = lambda: models["fp32"].generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=[])
    samples = interleaved_samples(fns, "cpu", repeats=repeats + 2 * roofline, warmup=1)
    times = {name: statistics.median(t) for name, t in samples.items()}
    same = out["ours"].shape == out["peer"].shape and bool((out["ours"] == out["peer"]).all())
    extra = {"same_tokens": same,
             "target": {("fp32", 1): 1.1, ("fp32", 8): 1.5, ("int8", 1): 1.1, ("int8", 8): 1.2}[dtype, batch]}
    if roofline:
        # Roofline at batch 1: a step reads every weight once, at the bandwidth sampled around it;
        # tformer reads its output layer's bf16 screen (greedy), CTranslate2 the fp32 weight.
        ours_bytes, peer_bytes = bytes_per_token(models["fp32"]), bytes_per_token(models["fp32"], screened=False)
        before, after = [probe.gbps(t) for t in samples["read"]], [probe.gbps(t) for t in samples["read after"]]
        gbps = statistics.median(before + after)
        extra.update(ceiling=gbps * 1e9 / ours_bytes,
                     utilisation=share_of_reads_around(samples["tformer"], new * ours_bytes, before, after),
                     peer_utilisation=share_of_reads_around(samples["peer"], new * peer_bytes, after,
                                                            before[1:] + after[-1:]),
                     utilisation_by_median_read=new / times["tformer"] * ours_bytes / gbps / 1e9,
                     read_GBps_samples=before + after,
                     bytes_per_token=ours_bytes, peer_bytes_per_token=peer_bytes,
                     utilisation_name=f"of roofline (BW {gbps:.0f} GB/s)")
    name = f"GPT-2{'' if not quick else ' 2-layer'} b{batch} {dtype} p32+{new}"
    rows = [engine_row(name, "tok/s", batch * new / times["tformer"], batch * new / times["peer"],
                       f"CTranslate2 {dtype}", **extra)]
    if "fp32" in times:
        rows.append(engine_row(f"{name}: quantize_int8(fp32 model) vs fp32", "tok/s", new / times["tformer"],
                               new / times["fp32"], "tformer fp32", target=1.0))
    return rows


def marian_rows(quick: bool) -> list[dict]:
    """Beam-4 translation of random-id sentences with an OPUS-MT-shaped Marian, batches of 16."""
    from transformers import MarianConfig, MarianMTModel

    from ..inference.quant import quantize_int8

    n, new, batch = (16, 8, 16) if quick else (64, 32, 16)
    torch.manual_seed(0)
    shape = dict(MARIAN, encoder_layers=2, decoder_layers=2) if quick else MARIAN
    hf = MarianMTModel(MarianConfig(**shape)).eval()
    ours = from_hf_model(hf).eval()
    models = {"fp32": ours, "int8": quantize_int8(copy.deepcopy(ours))}
    g = torch.Generator().manual_seed(0)
    vocab, eos, pad = shape["vocab_size"], shape["eos_token_id"], shape["pad_token_id"]
    lengths = torch.randint(8, 40, (n,), generator=g).tolist()
    sources = [torch.randint(2, vocab - 1, (k,), generator=g).tolist() + [eos] for k in lengths]
    batches = [sources[i:i + batch] for i in range(0, n, batch)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        names = {eos: "</s>", 1: "<unk>", pad: "<pad>"}
        hf_dir = hf_directory(ours, Path(tmp), names, {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})
        name_of = numbered_tokenizer(vocab, names).id_to_token
        for dtype, path in ct2_models(hf_dir, tmp).items():
            peer = PeerProcess(ct2_peer, "translator", path, dtype, peer_threads())
            out: dict[str, list] = {}

            def run_ours(m=models[dtype]):
                out["ours"] = []
                for b in batches:
                    ids, mask = pad_rows(b, pad)
                    seqs = m.generate(ids, attention_mask=mask, num_beams=4, max_new_tokens=new, eos_token_id=[])
                    out["ours"] += [s[1:].tolist() for s in seqs]             # without the start token

            def run_peer():
                out["peer"] = peer([[name_of(i) for i in s] for s in sources], new, batch)

            with peer:
                times = interleaved_times({"tformer": run_ours, "peer": run_peer}, "cpu",
                                          repeats=1 if quick else 3, warmup=1)
            same = sum([name_of(i) for i in a] == b for a, b in zip(out["ours"], out["peer"])) / n
            extra = {"same_output": same, "target": 1.3 if dtype == "fp32" else 1.0}
            if dtype == "fp32":
                extra["same_as_hf"] = same_as_hf_beam(hf, batches[0], out["ours"][:len(batches[0])], pad, new)
            rows.append(engine_row(f"Marian 6+6/512/V32k {n} sent. beam 4 b{batch} {dtype}" if not quick else
                             f"Marian 2+2/512/V32k {n} sent. beam 4 b{batch} {dtype}", "sent/s",
                             n / times["tformer"], n / times["peer"], f"CTranslate2 {dtype}", **extra))
    return rows


def same_as_hf_beam(hf, batch: list[list[int]], ours: list[list[int]], pad: int, new: int) -> bool:
    ids, mask = pad_rows(batch, pad)
    with torch.inference_mode():
        seqs = hf.generate(ids, attention_mask=mask, num_beams=4, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, forced_eos_token_id=None)     # HF would force EOS at the end
    return [s[1:].tolist() for s in seqs] == ours
