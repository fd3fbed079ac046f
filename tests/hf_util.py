"""Shared by the tests/test_hf_*.py files: offline Hugging Face models with random weights, saved
to a directory, and comparisons of tformer against them."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # nothing may try the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()            # "newly initialized" notices are expected here


def save_hf(model, path, seed: int = 0, share_embeddings: bool = False):
    """Re-initialise `model` from `seed` with weights big enough to make logits clearly ordered
    (HF's N(0, 0.02) makes greedy ties likely), then save_pretrained(path). `share_embeddings`
    gives a seq2seq model's encoder and decoder the values of its shared embedding (transformers 5
    keeps them as separate tensors when the head is untied)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:          # fixed tables (Marian's sinusoidal positions) stay as built
                continue
            if "norm" in name.lower() or "ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if p.dim() == 1 and name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("final_logits_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
        if share_embeddings:
            for side in (model.model.encoder, model.model.decoder):
                side.embed_tokens.weight.copy_(model.model.shared.weight)
    model.save_pretrained(str(path))
    return model.eval()


def batch(vocab: int, rows: int, length: int, seed: int, pad_side: str = "right", min_len: int = 2):
    """(ids, mask): rows of different real lengths, padded on `pad_side` (mask 1 = token, 0 = pad)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=gen)
    lengths = [length] + torch.randint(min_len, length, (rows - 1,), generator=gen).tolist()
    mask = torch.zeros(rows, length, dtype=torch.long)
    for i, n in enumerate(lengths):
        if pad_side == "right":
            mask[i, :n] = 1
        else:
            mask[i, length - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


def assert_close_real(ours, theirs, mask):
    """Equal at real (unpadded) positions; padded positions are free to differ."""
    keep = mask.bool()
    torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-4, atol=1e-5)


def state_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
