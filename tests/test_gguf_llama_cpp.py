"""llama.cpp runs what tformer exports: the same tokens, the same greedy continuations, logits within
stated bounds. Needs llama-cpp-python (`pip install llama-cpp-python`, built from source with the
machine's compiler); skipped with that message otherwise.

Token ids go to llama.cpp directly (`Llama.eval`), so its tokenizer is not in the way of the model
comparison; its tokenizer is compared on its own (`Llama.tokenize`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_util import SHAPES, bpe_tokenizer, decoder, logits
from tformer.checkpoints.gguf import to_gguf

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                                "llama-cpp-python): the llama.cpp parity checks are skipped")

PROMPTS = ["To be, or not to be, that is", "Whether 'tis nobler in the mind", "Être ou ne pas être, 1601"]
NEW_TOKENS = 64
# f32 files, logits relative to max|logit| (with an f32 KV cache): llama.cpp's llama differs from
# tformer only in summation order (measured 4e-6 over three seeds of each shape); its gpt2 also in the
# GELU, which ggml computes through an f16 table (error up to 2^-11 per activation; measured 5.5e-4).
# A greedy step where tformer's two best logits are within twice the bound may go either way.
F32_TOLERANCE = {"gpt2": 4 * 2 ** -11, "llama": 1e-4, "llama-tied": 1e-4}
# f16 / q8_0 files: llama.cpp also rounds the activations a matrix multiplies (to f16, or to q8_0
# blocks: another 1/254 of each block's largest value), so its error is about twice tformer's weight
# rounding alone (tests/test_gguf.py bounds that by 30 ε); 60 ε here: f16 ε = 2^-11, q8_0 ε = 1/254
# (measured: f16 4.6e-3, q8_0 1.4e-1 of max|logit|).
TOLERANCE = {"f16": 60 * 2 ** -11, "bf16": 60 * 2 ** -8, "q8_0": 60 / 254}


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


def load(path, n_ctx: int = 128):
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=2, seed=0,
                           type_k=0, type_v=0)     # an f32 KV cache (GGML_TYPE_F32; llama.cpp keeps f16 by default)


def llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def llama_logits(llm, ids: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))


@pytest.mark.parametrize("shape", SHAPES)
def test_llama_cpp_tokenizes_and_greedy_decodes_as_tformer(shape, tokenizer, tmp_path):
    model = decoder(shape, tokenizer)
    llm = load(to_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer))
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=False) == ids
        assert llm.detokenize(ids).decode("utf-8") == prompt
        ours = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=[])[0, len(ids):].tolist()
        theirs = llama_greedy(llm, ids, NEW_TOKENS)
        bound = F32_TOLERANCE[shape]
        if ours != theirs:       # allowed only at a near-tie of tformer's own logits
            k = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            step = logits(model, torch.tensor([ids + ours[:k]]))[0, -1]
            top2 = step.topk(2).values
            assert top2[0] - top2[1] <= 2 * bound * step.abs().max(), \
                f"{shape}, {prompt!r}: llama.cpp chose {theirs[k]} at step {k}, tformer {ours[k]} by a clear margin"
        seq = ids + theirs       # and the logits themselves, along llama.cpp's continuation
        ours_logits = logits(model, torch.tensor([seq]))[0]
        assert (llama_logits(llm, seq) - ours_logits).abs().max() <= bound * ours_logits.abs().max()


@pytest.mark.parametrize("type", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("shape", SHAPES)
def test_llama_cpp_logits_of_f16_bf16_and_q8_0_files(shape, type, tokenizer, tmp_path):
    model = decoder(shape, tokenizer)
    llm = load(to_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer, type=type))
    ids = tokenizer.encode(" ".join(PROMPTS))
    ours, theirs = logits(model, torch.tensor([ids]))[0], llama_logits(llm, ids)
    assert (ours - theirs).abs().max() <= TOLERANCE[type] * ours.abs().max()


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_llama_cpp_runs_a_file_without_a_tokenizer(shape, tokenizer, tmp_path):
    """tokenizer.ggml.model = "none" with {arch}.vocab_size: llama.cpp runs the model on token ids."""
    model = decoder(shape, tokenizer)
    llm = load(to_gguf(model, tmp_path / "m.gguf"))
    ids = tokenizer.encode(PROMPTS[0])
    ours = logits(model, torch.tensor([ids]))[0]
    assert (llama_logits(llm, ids) - ours).abs().max() <= F32_TOLERANCE[shape] * ours.abs().max()


def test_llama_cpp_splits_text_as_a_llama_3_style_tokenizer(tokenizer, tmp_path):
    from gguf_util import llama3_style_tokenizer

    llama3 = llama3_style_tokenizer()
    llm = load(to_gguf(decoder("llama", tokenizer), tmp_path / "m.gguf", tokenizer=llama3))
    for text in [*PROMPTS, "it's 12345 tokens,\r\n\n  spaced   out"]:
        ids = llama3.encode(text)
        assert llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) == ids
        assert llm.detokenize(ids).decode("utf-8") == text
