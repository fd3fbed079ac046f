"""Tokenizers: text <-> token ids, stored as a standard Hugging Face `tokenizer.json`.

Two kinds are trained from data, both with the HF `tokenizers` library:

  char  every character is one token (a WordLevel vocabulary over single characters, split by a
        one-character regex, joined back by a Fuse decoder). Round-trips any text written in the
        training alphabet exactly; other characters become `<unk>`.
  bpe   byte-level BPE (GPT-2 style): text -> UTF-8 bytes -> learned merges. Round-trips any text.
  wordpiece  BERT-style, uncased: lower-cased, accents stripped, split at spaces and punctuation,
        words cut into learned pieces (##suffixes). Does not round-trip (case is lost), but for
        classifying short texts it shares more statistics between "Great"/"great" and "film,"/"film".

One is shipped ready-made:

  bert-uncased  BERT's uncased WordPiece vocabulary (30,522 pieces; the one bert-base-uncased and
        all-MiniLM-L6-v2 use, Apache-2.0, `assets/bert-uncased.json`): pieces learned from a large
        corpus, which a small labelled data set cannot learn itself.

Any other `tokenizer.json` (e.g. a BERT WordPiece one) loads with `Tokenizer.from_file`.
Special tokens: `<pad>`, `<bos>`, `<eos>` (ids 0, 1, 2) in both trained kinds; in a char tokenizer
they are ordinary vocabulary entries that no single character can produce, so text containing the
string "<pad>" still round-trips; in BPE they are special tokens that are never matched in text.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from ..errors import CheckpointError, DataError

SPECIALS = ("<pad>", "<bos>", "<eos>")
SHIPPED = {"bert-uncased": Path(__file__).parent / "assets" / "bert-uncased.json"}  # --tokenizer NAME
UNK = "<unk>"
# Names other tokenizers use for the same roles, tried in order when loading a tokenizer.json.
ROLE_NAMES = {
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "bos": ("<bos>", "<s>", "[CLS]", "<|endoftext|>"),
    "eos": ("<eos>", "</s>", "[SEP]", "<|endoftext|>"),
}


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` (`.hf`) with the ids of the special roles."""

    def __init__(self, hf, kind: str = "file"):
        self.hf = hf
        self.kind = kind
        # Special tokens are never recognised inside user text: "<eos>" in a play is five characters.
        self.hf.encode_special_tokens = True
        # Some tokenizer.json files (e.g. MiniLM's) pad every encoding to a fixed length; tformer
        # pads batches itself and truncates with a warning, so one text is exactly its tokens.
        self.hf.no_padding()
        self.hf.no_truncation()
        self.pad_id, self.bos_id, self.eos_id = (self._role(r) for r in ("pad", "bos", "eos"))
        self.special_ids = {i for i in (self.pad_id, self.bos_id, self.eos_id) if i is not None}

    def _role(self, role: str) -> int | None:
        for name in ROLE_NAMES[role]:
            i = self.hf.token_to_id(name)
            if i is not None:
                return i
        return None

    # --- constructors --------------------------------------------------------------------
    @classmethod
    def char(cls, text: str) -> "Tokenizer":
        """One token per distinct character of `text` (sorted, after the special tokens and <unk>)."""
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        if not text:
            raise DataError("cannot build a character tokenizer from empty text")
        vocab = {tok: i for i, tok in enumerate((*SPECIALS, UNK, *sorted(set(text))))}
        hf = HFTokenizer(models.WordLevel(vocab, unk_token=UNK))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every code point
        hf.decoder = decoders.Fuse()  # join the characters with nothing in between
        return cls(hf, "char")

    @classmethod
    def train_bpe(cls, texts: Iterable[str] | str, vocab_size: int) -> "Tokenizer":
        """Byte-level BPE with `vocab_size` entries (256 byte symbols + merges + 3 special tokens)."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        minimum = 256 + len(SPECIALS)
        if vocab_size < minimum:
            raise DataError(f"--vocab-size {vocab_size} is too small for byte-level BPE (at least {minimum})")
        texts = [texts] if isinstance(texts, str) else texts
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        hf.train_from_iterator(_chunks(texts), trainer)
        return cls(hf, "bpe")

    @classmethod
    def train_wordpiece(cls, texts: Iterable[str] | str, vocab_size: int, lowercase: bool = True) -> "Tokenizer":
        """BERT-style WordPiece with `vocab_size` entries (special tokens and <unk> included)."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

        if vocab_size < 2 * len(SPECIALS):
            raise DataError(f"--vocab-size {vocab_size} is too small for WordPiece")
        texts = [texts] if isinstance(texts, str) else texts
        hf = HFTokenizer(models.WordPiece(unk_token=UNK))
        hf.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        hf.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=[*SPECIALS, UNK], show_progress=False)
        hf.train_from_iterator(_chunks(texts), trainer)
        return cls(hf, "wordpiece")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist (expected a tokenizer.json file)")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception for malformed files
            raise CheckpointError(f"{path} is not a valid tokenizer.json ({e})") from None
        return cls(hf, _guess_kind(hf))

    @classmethod
    def from_str(cls, json_text: str) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        hf = HFTokenizer.from_str(json_text)
        return cls(hf, _guess_kind(hf))

    # --- use -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        try:
            return self.hf.encode(text, add_special_tokens=False).ids
        except TypeError:
            check_text(text)
            raise

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        try:
            return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]
        except TypeError:
            for text in texts:
                check_text(text)
            raise

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """ids (a list or 1-D tensor) -> text; pad/bos/eos are dropped unless asked for."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self.hf.decode(ids, skip_special_tokens=False)

    def to_str(self) -> str:
        return self.hf.to_str()

    def save(self, path: str | os.PathLike) -> None:
        self.hf.save(str(path))

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"


def check_text(text) -> None:
    """Explain why `text` cannot be tokenized: lone surrogates, which is how Python hands over bytes
    that are not UTF-8 in command-line arguments and stdin (errors="surrogateescape")."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = text[e.start]
        if 0xDC80 <= ord(char) <= 0xDCFF:  # an undecodable byte carried through surrogateescape
            at = len(text[:e.start].encode("utf-8", "surrogateescape"))
            raise DataError(f"the text is not UTF-8: byte {at} is 0x{ord(char) - 0xDC00:02x} "
                            "(convert the input to UTF-8)") from None
        raise DataError(f"the text contains a lone surrogate U+{ord(char):04X} at character {e.start}, "
                        "which is not a Unicode character (remove it)") from None


def _chunks(texts: Iterable[str], size: int = 1 << 16):
    """Long texts in pieces, so the BPE trainer parallelises and its memory stays bounded.
    Pieces end at a newline where possible, so few words are cut in two."""
    for text in texts:
        start = 0
        while start < len(text):
            end = min(len(text), start + size)
            if end < len(text):
                nl = text.rfind("\n", start, end)
                end = nl + 1 if nl > start else end
            yield text[start:end]
            start = end


def _guess_kind(hf) -> str:
    import json

    model = json.loads(hf.to_str()).get("model", {})
    if model.get("type") == "WordLevel" and all(len(t) == 1 for t in model.get("vocab", {})
                                                if t not in (*SPECIALS, UNK)):
        return "char"
    if model.get("type") == "BPE":
        return "bpe"
    return str(model.get("type", "file")).lower()


def make_tokenizer(choice: str, texts: list[str], vocab_size: int) -> Tokenizer:
    """`tformer train --tokenizer CHOICE`: "char", "bpe" or "wordpiece" trained on `texts`, a shipped
    one by name ("bert-uncased"), or a tokenizer.json file (or a directory holding one, e.g. a Hugging
    Face model) used as it is."""
    if choice == "char":
        return Tokenizer.char("".join(texts))
    if choice == "bpe":
        return Tokenizer.train_bpe(texts, vocab_size)
    if choice == "wordpiece":
        return Tokenizer.train_wordpiece(texts, vocab_size)
    path = SHIPPED.get(choice, Path(choice))
    return Tokenizer.from_file(path / "tokenizer.json" if path.is_dir() else path)
