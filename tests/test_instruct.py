"""tformer-instruct: three splits that share no item, every reference reply in its task's form, the wrong
reply wrong, pretraining text without held-out items, and the scorer against direct computation."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tformer.data import corpora, instruct
from tformer.data.chat import Renderer
from tformer.data.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from tformer.data.tokenizers import Tokenizer
from tformer.evaluation import instruct as scorer
from tformer.model.config import ModelConfig
from tformer.model.models import Decoder


def source(item: instruct.Item) -> str:
    """The input the item's phrasing wraps: what must never be shared between splits."""
    for phrasing in instruct.PHRASINGS[item.task]:
        before, after = phrasing.split("{x}")
        if item.prompt.startswith(before) and item.prompt.endswith(after):
            return item.prompt[len(before):len(item.prompt) - len(after)]
    raise AssertionError(f"no phrasing of {item.task} makes {item.prompt!r}")


EN = "the and of to that in he shall unto for his they be is him not them it with all which my said".split()
ES = "de y que el la los en se no las por su con del lo le al para es mi como sus pero yo".split()


def small_bible() -> corpora.Pairs:
    """A stand-in for bible-en-es (whose first build reads two Sword modules for minutes): 60 chapters of
    20 verses of seeded English and Spanish function words, the shapes instruct's Bible tasks use."""
    rng = random.Random(0)
    sources, targets, groups = [], [], []
    for chapter in range(60):
        for verse in range(20):
            n = rng.randint(4, 14)
            sources.append(" ".join(rng.choice(EN) for _ in range(n)) + f" {chapter}:{verse}.")
            targets.append(" ".join(rng.choice(ES) for _ in range(n)) + f" {chapter}:{verse}.")
            groups.append(f"Book {chapter}")
    return corpora.Pairs(sources, targets, "bible-en-es", groups)


@pytest.fixture(scope="module")
def splits() -> dict[str, list[instruct.Item]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(corpora, "bible_en_es", small_bible)
        instruct._sources.cache_clear()
        yield {split: instruct.items(split) for split in instruct.SPLITS}
        instruct._sources.cache_clear()


def test_the_splits_share_no_input_and_hold_every_task(splits):
    inputs = {split: {(item.task, source(item)) for item in items} for split, items in splits.items()}
    assert not inputs["train"] & inputs["validation"]
    assert not inputs["train"] & inputs["test"]
    assert not inputs["validation"] & inputs["test"]
    for split, items in splits.items():
        assert {item.task for item in items} == set(instruct.TASKS), split
    numbers = {split: {i.answer for i in items if i.task == "numbers"} for split, items in splits.items()}
    assert not numbers["test"] & numbers["train"]          # a held-out number is never trained, in any phrasing


def test_every_reply_has_its_task_form_and_the_wrong_one_differs(splits):
    for item in splits["test"] + splits["validation"]:
        assert instruct.fits(item.task, item.answer), item
        assert item.wrong != item.answer, item
        others = [t for t in instruct.TASKS if t != item.task and instruct.fits(t, item.answer)]
        assert set(others) <= {"es-en", "continue"} - {item.task}, (item, others)   # the two English-prose tasks
    sentiment = [i for i in splits["test"] if i.task == "sentiment"]
    assert all({i.answer, i.wrong} == {"positive", "negative"} for i in sentiment)
    for i in (i for i in splits["test"] if i.task == "numbers"):
        assert len(re.findall(r"\w+", i.answer)) >= 1 and instruct.fits("numbers", i.wrong)


def test_a_split_is_the_same_in_a_fresh_process(splits):
    code = ("import hashlib, test_instruct as t; from tformer.data import corpora, instruct; "
            "corpora.bible_en_es = t.small_bible; "
            "print(hashlib.sha256(repr(instruct.items('test')).encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent).stdout.strip()
    import hashlib
    assert out == hashlib.sha256(repr(splits["test"]).encode()).hexdigest()


def test_pretraining_text_holds_no_held_out_item(splits):
    lines = set(instruct.pretraining_text().splitlines())
    for split in ("validation", "test"):
        for item in splits[split]:
            assert source(item) not in lines, item
            if item.task not in ("sentiment", "speaker", "entities"):   # labels recur; texts must not
                assert item.answer not in lines, item


def test_a_wrong_line_of_the_play_comes_from_its_own_split(splits):
    """continue's rejected reply: a held-out item weighs two lines never trained on (a memorised training line
    would score above the true next line), and no training pair rejects a held-out line."""
    lines = set(instruct.pretraining_text().splitlines())
    held = {i.answer for split in ("validation", "test") for i in splits[split] if i.task == "continue"}
    for item in (i for split in ("validation", "test") for i in splits[split] if i.task == "continue"):
        assert item.wrong not in lines and item.wrong != item.answer, item
    assert not {i.wrong for i in splits["train"] if i.task == "continue"} & held


def test_routing_check_refuses_other_forms():
    assert instruct.fits("numbers", "three thousand, four hundred and ten")
    assert not instruct.fits("numbers", "trois mille")
    assert instruct.fits("entities", "person: Bob Dylan; geo-loc: Paris") and instruct.fits("entities", "none")
    assert not instruct.fits("entities", "Bob Dylan")
    assert instruct.fits("en-es", "Y dijo Dios: Sea la luz.") and not instruct.fits("es-en", "Y dijo Dios: Sea la luz.")
    assert instruct.fits("speaker", "Hamlet") and not instruct.fits("speaker", "hamlet")
    assert not instruct.fits("continue", "positive") and not instruct.fits("continue", "")


# --- the scorer ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(splits):
    items = [i for i in splits["test"] if i.task in ("numbers", "sentiment", "speaker")][:12]
    text = " ".join(i.prompt + " " + i.answer + " " + i.wrong for i in items) + " user assistant"
    tok = Tokenizer.train_bpe(text, 400)
    torch.manual_seed(0)
    cfg = ModelConfig(kind="decoder", vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                      max_seq_len=256, positional="rope", pad_token_id=tok.pad_id, bos_token_id=tok.bos_id,
                      eos_token_id=tok.eos_id, dropout=0.0)
    from tformer.tasks.sft import make_special
    make_special(tok, ["<bos>", "<eos>"])
    return Decoder(cfg).eval(), tok, ChatTemplate(DEFAULT_TEMPLATE, "<bos>", "<eos>"), items


def test_preference_is_the_sum_of_the_reply_token_logprobs(chat_model):
    model, tok, template, items = chat_model
    renderer = Renderer(tok, template)
    for item in items[:4]:
        scores = []
        for reply in (item.answer, item.wrong):
            r = renderer(scorer.example(item, reply))
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([r.ids]))[0], -1)
            scores.append(sum(float(logp[t - 1, r.ids[t]]) for t in range(1, len(r.ids)) if r.trained[t]))
        assert scorer.preferences(model, renderer, [item]) == [scores[0] > scores[1]]
        both = scorer.reply_logprobs(model, [renderer(scorer.example(item, x)) for x in (item.answer, item.wrong)])
        assert both.tolist() == pytest.approx(scores, abs=1e-4)


def test_batched_replies_equal_replies_one_at_a_time(chat_model):
    model, tok, template, items = chat_model
    renderer = Renderer(tok, template)
    batched = scorer.answers(model, renderer, items, batch_size=5)
    assert batched == [scorer.answers(model, renderer, [item])[0] for item in items]
    figures = scorer.score(model, tok, template, items)
    assert figures["routing"] == sum(instruct.fits(i.task, r) for i, r in zip(items, batched)) / len(items)
    assert 0.0 <= figures["preference_accuracy"] <= 1.0 and "numbers_exact_match" in figures


@pytest.mark.parametrize("split", [None, "validation"], ids=["default-test", "validation"])
def test_tformer_eval_reports_the_test_split_figures(chat_model, tmp_path, capsys, split):
    """By default the test split; --split validation (where recipes are chosen) scores that split instead (it
    once scored the test split whatever --split said)."""
    import json

    import tformer
    from tformer.cli import main

    model, tok, template, _ = chat_model
    tformer.save(model, tmp_path / "assistant", tokenizer=tok)
    (tmp_path / "assistant" / "chat_template.jinja").write_text(DEFAULT_TEMPLATE)
    (tmp_path / "assistant" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>",
                                                                               "eos_token": "<eos>"}))
    assert main(["eval", "--model", str(tmp_path / "assistant"), "--data", "tformer-instruct", "--limit", "24",
                 "--json", *(["--split", split] if split else [])]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out.strip().splitlines()[0])
    assert f"split: {split or 'test'} (the first 24 of" in err
    loaded = tformer.load(tmp_path / "assistant")
    direct = scorer.score(loaded, tok, template, instruct.items(split or "test")[:24])
    assert printed == {k: direct[k] for k in printed}
    assert set(printed) >= {"routing", "preference_accuracy"}
