"""BertForTokenClassification <-> EncoderTokenClassifier: on tiny random configs the per-token
logits equal transformers' both ways (from_hf and to_hf), with padding and token types."""

import json

import pytest
import torch

import tformer
from hf_util import assert_close_real, batch, save_hf, state_equal, transformers
from tformer.model.heads import EncoderTokenClassifier

LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
CONFIG = dict(vocab_size=57, hidden_size=24, num_attention_heads=3, num_hidden_layers=2, intermediate_size=40,
              max_position_embeddings=32, id2label=dict(enumerate(LABELS)),
              label2id={name: i for i, name in enumerate(LABELS)})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert-ner")
    hf = save_hf(transformers.BertForTokenClassification(transformers.BertConfig(**CONFIG)), path, seed=31)
    return hf, tformer.from_hf(path)


def test_from_hf_logits_equal_bert_for_token_classification(pair):
    hf, ours = pair
    assert isinstance(ours, EncoderTokenClassifier) and ours.labels == LABELS
    ids, mask = batch(ours.cfg.vocab_size, 3, 11, seed=4)
    types = (torch.arange(11) >= 5).long().expand(3, 11)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        assert_close_real(ours(ids, mask, types), expected, mask)


def test_to_hf_logits_equal_in_transformers(tmp_path):
    """A tagger built in tformer (random weights) -> to_hf -> transformers' own class gives its logits."""
    torch.manual_seed(5)
    cfg = tformer.ModelConfig(kind="encoder", vocab_size=41, d_model=32, n_heads=4, n_layers=2, d_ff=48,
                              max_seq_len=24, norm_position="post", embedding_norm=True, type_vocab_size=2,
                              norm_eps=1e-12)
    ours = EncoderTokenClassifier(cfg, len(LABELS), LABELS).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    out = tformer.to_hf(ours, tmp_path / "export")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["BertForTokenClassification"]
    hf = transformers.AutoModelForTokenClassification.from_pretrained(out).eval()
    assert type(hf).__name__ == "BertForTokenClassification"
    assert [hf.config.id2label[i] for i in range(len(LABELS))] == LABELS
    ids, mask = batch(cfg.vocab_size, 3, 9, seed=6)
    with torch.no_grad():
        assert_close_real(hf(input_ids=ids, attention_mask=mask).logits, ours(ids, mask), mask)
    assert state_equal(tformer.from_hf(out), ours)


def test_tagger_survives_save_and_load(pair, tmp_path):
    _, ours = pair
    tformer.save(ours, tmp_path / "m")
    again = tformer.load(tmp_path / "m")
    assert isinstance(again, EncoderTokenClassifier) and again.labels == LABELS and state_equal(again, ours)
