"""The bible-en-es corpus: English (World English Bible) and Spanish (Reina-Valera 1909) verses from
the Debian sword-text-web / sword-text-sparv modules (public domain), read with pysword, the OSIS
markup stripped, paired by verse and cached once as TSV."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import DataError
from ..kernels.build import cache_root

SWORD_DIR = "/usr/share/sword"
BIBLE_MODULES = {"en": ("engWEB2015eb", "sword-text-web"), "es": ("spaRV1909eb", "sword-text-sparv")}

_REMOVE_WITH_CONTENT = re.compile(r"<(note|title)\b[^>]*?(?<!/)>.*?</\1>", re.S)
_INLINE_TAGS = re.compile(r"</?(w|q|transChange|hi|foreign|divineName|seg|rdg|name|reference|catchWord)\b[^>]*>")
_ANY_TAG = re.compile(r"<[^>]*>")


def strip_osis(text: str) -> str:
    """Plain verse text from OSIS markup. Footnotes and headings become a space (removing them outright
    would glue the words around them together: "God<note>...</note>created"); word-level tags
    (<w>, <q>, <transChange>...) vanish; block tags (<l>, <lb/>, <div>...) become a space."""
    text = _REMOVE_WITH_CONTENT.sub(" ", text)
    text = _INLINE_TAGS.sub("", text)
    text = _ANY_TAG.sub(" ", text)
    return " ".join(text.split())


def _read_sword_module(modules, name: str) -> dict[tuple[str, int, int], str]:
    bible = modules.get_bible_from_module(name)
    verses = {}
    books = bible.get_structure().get_books()
    for book in books.get("ot", []) + books.get("nt", []):
        for chapter, n_verses in enumerate(book.chapter_lengths, 1):
            texts = bible.get(books=[book.osis_name], chapters=[chapter], clean=False, join="\x00").split("\x00")
            for verse, text in enumerate(texts[:n_verses], 1):
                verses[(book.osis_name, chapter, verse)] = strip_osis(text)
    return verses


def build_bible(sword_dir: str = SWORD_DIR) -> list[tuple[str, int, int, str, str]]:
    """(book, chapter, verse, english, spanish) for every verse both modules have and neither leaves empty."""
    try:
        from pysword.modules import SwordModules
    except ImportError:
        raise DataError("the bible-en-es data needs pysword (pip install pysword)") from None
    missing = [pkg for mod, pkg in BIBLE_MODULES.values()
               if not (Path(sword_dir) / "mods.d" / f"{mod}.conf").exists()]
    if missing:
        raise DataError(f"the Bible modules are not installed in {sword_dir} (run `make system-deps`, or "
                        f"`apt-get install {' '.join(missing)}`)")
    modules = SwordModules(sword_dir)
    modules.parse_modules()
    en = _read_sword_module(modules, BIBLE_MODULES["en"][0])
    es = _read_sword_module(modules, BIBLE_MODULES["es"][0])
    return [(*key, en[key], es[key]) for key in en if key in es and en[key] and es[key]]


def verse_pairs(sword_dir: str = SWORD_DIR) -> list[tuple[str, int, str, str]]:
    """(book, chapter, english, spanish) of every aligned verse, converted from the sword modules once
    and cached as TSV (cache_root()/bible-en-es.tsv)."""
    path = cache_root() / "bible-en-es.tsv"
    if not path.exists():
        rows = build_bible(sword_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            for book, chapter, verse, en, es in rows:
                f.write(f"{book}\t{chapter}\t{verse}\t{_tsv_safe(en)}\t{_tsv_safe(es)}\n")
        os.replace(tmp, path)
    verses = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            book, chapter, _, en, es = line.rstrip("\n").split("\t")
            if _aligned(en, es):
                verses.append((book, int(chapter), en, es))
    return verses


def _aligned(en: str, es: str) -> bool:
    """False for the few verses the two versifications split differently (or the WEB glossary that
    follows Revelation 22:21): one side over 3x longer than the other, ignoring short verses."""
    a, b = len(en.split()), len(es.split())
    return max(a, b) <= 20 or max(a, b) <= 3 * min(a, b)


def _tsv_safe(text: str) -> str:
    return text.replace("\t", " ").replace("\n", " ")
