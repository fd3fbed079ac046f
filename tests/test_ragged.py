"""A ragged batch (model/ragged.py): the new tokens of several caches in one model.step. Reference: each
sequence run alone through the model's plain forward pass (no cache), at every position asked for."""

import pytest
import torch

from tformer import Decoder, ModelConfig
from tformer.model.ragged import Part, RaggedCache

GPT = dict()                                                              # learned positions, LayerNorm, GELU
LLAMA = dict(positional="rope", norm="rmsnorm", activation="swiglu", bias=False, n_kv_heads=2)


def build(**kw):
    torch.manual_seed(0)
    cfg = dict(kind="decoder", vocab_size=41, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=64)
    return Decoder(ModelConfig(**{**cfg, **kw})).eval()


def alone(model, ids: list[int]) -> torch.Tensor:
    """Every position's logits of `ids` run alone, (T, V)."""
    return model(torch.tensor([ids]))[0]


@pytest.mark.parametrize("kind", [GPT, LLAMA], ids=["gpt", "llama-gqa"])
def test_decoding_rows_and_prompt_chunks_in_one_step_equal_each_alone(kind):
    model = build(**kind)
    g = torch.Generator().manual_seed(1)
    seq = [torch.randint(0, 41, (n,), generator=g).tolist() for n in (6, 4, 10, 7)]
    with torch.inference_mode():
        # part 0: two rows decoding (the second left-padded: its own positions, a mask over the padding)
        rows = model.new_cache(2, 32)
        mask = torch.tensor([[1] * 5, [0, 0] + [1] * 3])
        prompts = torch.tensor([seq[0][:5], [0, 0] + seq[1][:3]])
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        model.step(prompts, rows, mask, positions)
        # part 1: a prompt with 3 positions cached, its next chunk of 5; part 2: a new prompt's first 7 tokens
        middle = model.new_cache(1, 32)
        model.step(torch.tensor([seq[2][:3]]), middle)
        fresh = model.new_cache(1, 32)
        parts = [Part(rows, 2, 1, torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)),
                 Part(middle, 1, 5), Part(fresh, 1, 7)]
        ids = [seq[0][5], seq[1][3], *seq[2][3:8], *seq[3]]
        pos = [5, 3, *range(3, 8), *range(7)]
        hidden = model.step(torch.tensor(ids)[:, None], RaggedCache(parts), positions=torch.tensor(pos)[:, None],
                            head=False)                                                   # (N, D)
        got = model.lm_head(hidden)
        want = torch.cat([alone(model, seq[0])[5:6], alone(model, seq[1])[3:4], alone(model, seq[2][:8])[3:8],
                          alone(model, seq[3])])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # every cache holds its part's new keys: the next token of each continues as alone
        assert (rows.length, middle.length, fresh.length) == (6, 8, 7)
        nxt = model.step(torch.tensor([[seq[2][8]]]), middle)
        torch.testing.assert_close(nxt, alone(model, seq[2][:9])[8:9], atol=1e-5, rtol=1e-5)
