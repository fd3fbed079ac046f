"""Masks: bool, True = may attend."""

import torch

from tformer.model.masks import causal_mask, combine, padding_mask


def test_causal_mask_is_lower_triangular():
    m = causal_mask(4)
    assert m.dtype == torch.bool and m.shape == (4, 4)
    for i in range(4):
        for j in range(4):
            assert bool(m[i, j]) == (j <= i)


def test_causal_mask_with_cache_offset():
    """3 new queries after 2 cached positions: query i is position i + 2 and sees keys 0..i+2."""
    m = causal_mask(3, 5)
    assert m.shape == (3, 5)
    for i in range(3):
        assert m[i].tolist() == [j <= i + 2 for j in range(5)]
    assert causal_mask(1, 7).all()                                     # one new token sees everything


def test_padding_mask_from_hf_convention():
    hf = torch.tensor([[1, 1, 0], [0, 1, 1]])
    m = padding_mask(hf)
    assert m.shape == (2, 1, 1, 3) and m.dtype == torch.bool
    assert m[:, 0, 0].tolist() == [[True, True, False], [False, True, True]]


def test_combine_is_and_and_opens_empty_rows():
    hf = torch.tensor([[0, 1, 1]])                                     # left padding
    m = combine(causal_mask(3), padding_mask(hf))                      # (1, 1, 3, 3)
    assert m.shape == (1, 1, 3, 3)
    # query 0 (a pad) could see only key 0 (a pad): its row is opened instead of left empty (NaN)
    assert m[0, 0].tolist() == [[True, True, True], [False, True, False], [False, True, True]]
    assert combine(None, None) is None
    c = causal_mask(3)
    assert torch.equal(combine(None, c), c)
