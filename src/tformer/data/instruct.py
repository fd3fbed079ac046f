"""tformer-instruct: instructions and preferences built from the built-in corpora (`--data tformer-instruct`
for `--task sft` and `--task dpo`, and `--task lm` pretrains on the same texts without the instructions).

Seven tasks, each asked in several phrasings (one drawn per item, seeded):

    numbers     a French number in words -> English words          (numbers-fr-en: num2words)
    sentiment   a review sentence -> "positive" or "negative"       (rotten-tomatoes: fresh / rotten)
    en-es       an English verse -> Spanish                         (bible-en-es)
    es-en       a Spanish verse -> English                          (bible-en-es)
    entities    a tweet -> "type: words; type: words" or "none"     (wnut16)
    speaker     a line of Hamlet -> who speaks it                   (hamlet)
    continue    a line of Hamlet -> the next line of the speech     (hamlet)

Three splits that never share an item: `train` (what --task sft/dpo/lm learn from), `validation` (their
held-out loss and preference accuracy) and `test` (what `tformer eval --data tformer-instruct` reports, never
seen in training). Whole units are held out: Bible chapters, Hamlet speeches, tweets, sentences, numbers.

Every item also carries a plausible wrong reply (`wrong`), the rejected side of the preference set: a number
with one digit changed, the other sentiment, the next verse's translation, the entities with a wrong type
(or one invented where there are none), another speaker, the next line of another speech of the same split.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from functools import cache
from itertools import repeat

from . import corpora
from .chat import Example
from .files import read_text

NAME = "tformer-instruct"
SPLITS = ("train", "validation", "test")
HELD_OUT = {"validation": 200, "test": 200}   # items per task in each held-out split (Bible: chapters' worth)
LARGE_HELD_OUT = {"validation": 300, "test": 500}   # numbers and sentiment: a test figure within ~2 points
TRAIN_NUMBERS = 15000
TRAIN_VERSES = 3000   # per direction: verses are the longest items, the rest of the Bible is left out

PHRASINGS = {
    "numbers": ["Translate this French number into English: {x}", "What is \"{x}\" in English?",
                "French to English: {x}", "Write the English words for the French number {x}."],
    "sentiment": ["Is this review positive or negative? {x}", "Sentiment of this review: {x}",
                  "Review: {x}\nWas the critic's verdict positive or negative?",
                  "Classify the review as positive or negative.\n{x}"],
    "en-es": ["Translate into Spanish: {x}", "How do you say this in Spanish? {x}",
              "English to Spanish: {x}", "Give the Spanish translation of this verse: {x}"],
    "es-en": ["Translate into English: {x}", "What does this Spanish verse say in English? {x}",
              "Spanish to English: {x}", "Give the English translation: {x}"],
    "entities": ["List the named entities in this tweet: {x}", "Which entities does this tweet mention? {x}",
                 "Tweet: {x}\nName its entities with their types.", "Find the named entities: {x}"],
    "speaker": ["Who says this line in Hamlet? {x}", "In Hamlet, who speaks the line \"{x}\"?",
                "Line: {x}\nWhich character says it?", "Name the speaker of this line from Hamlet: {x}"],
    "continue": ["Continue this line from Hamlet: {x}", "What comes after \"{x}\" in Hamlet?",
                 "Hamlet, the next line after: {x}", "Give the line of the play that follows: {x}"],
}
TASKS = tuple(PHRASINGS)
STAGE = ("Enter", "Exit", "Exeunt", "Re-enter")     # stage directions inside a speech
CORPUS = {"en-es": "bible", "es-en": "bible", "speaker": "hamlet", "continue": "hamlet"}   # tasks sharing texts
SENTIMENT = {"fresh": "positive", "rotten": "negative"}


@dataclass(frozen=True)
class Item:
    task: str
    prompt: str     # the user's message: an instruction and its input
    answer: str     # the reference reply
    wrong: str      # a plausible wrong reply (DPO's rejected)

    def messages(self, reply: str | None = None) -> list[dict]:
        turns = [{"role": "user", "content": self.prompt}]
        return turns if reply is None else [*turns, {"role": "assistant", "content": reply}]


def items(split: str, seed: int = 0) -> list[Item]:
    """Every task's items of one split, in a seeded order; the same for a (split, seed) on every machine."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; one of {SPLITS}")
    rng = random.Random(f"{NAME}-{split}-{seed}")
    out = [Item(task, rng.choice(PHRASINGS[task]).format(x=x), answer, wrong)
           for task, rows in _sources(seed).items() for x, answer, wrong in rows[split] if fits(task, answer)]
    rng.shuffle(out)
    return out


def examples(split: str, seed: int = 0) -> list[Example]:
    """The split's items as --task sft's conversations: the instruction, then the reference reply."""
    return [Example(f"{NAME}:{split}:{i}", messages=item.messages(item.answer))
            for i, item in enumerate(items(split, seed), 1)]


def preferences(split: str, seed: int = 0) -> list[tuple[str, Example, Example]]:
    """The split's items as --task dpo's pairs: (where, chosen = the reference reply, rejected = the wrong one),
    each side the prompt's messages and the reply, as tasks.dpo reads a JSONL line with a messages prompt."""
    out = []
    for i, item in enumerate(items(split, seed), 1):
        where, prompt = f"{NAME}:{split}:{i}", item.messages()
        sides = [[{"role": "assistant", "content": reply}] for reply in (item.answer, item.wrong)]
        out.append((where, *(Example(where, messages=prompt + r, prompt=prompt, completion=r) for r in sides)))
    return out


def pretraining_text(seed: int = 0) -> str:
    """The training split's texts without instructions (both sides of each pair), one per line: what
    `--task lm --data tformer-instruct` learns language from. No validation or test item is in it."""
    lines = []
    for rows in _sources(seed).values():
        for x, answer, _ in rows["train"]:
            lines += [x, answer] if answer not in SENTIMENT.values() else [x]
    random.Random(f"{NAME}-text-{seed}").shuffle(lines)
    return "\n".join(lines) + "\n"


# --- which task a reply answers (the routing check) -----------------------------------------------

NUMBER_WORDS = set("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                   "sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety "
                   "hundred thousand and".split())
ENGLISH = set("the and of to that in he shall unto for i his a they be is him not them it with all thou thy was "
              "which my me you said this have from but are by so as what".split())
SPANISH = set("de y que el la los en a se no las por su con del lo le al para es mi tu me como sus ha pero "
              "yo os más él á ó é".split())
_ENTITY = re.compile(r"(?:none|[a-z-]+: [^;]+(?:; [a-z-]+: [^;]+)*)")


def fits(task: str, reply: str, speakers: frozenset[str] | None = None) -> bool:
    """Whether `reply` has the form of `task`'s answers: number words, a sentiment label, Spanish prose (more
    Spanish function words than English), an entity list, a Hamlet speaker, English prose (es-en, continue:
    words, no more Spanish than English function words, none of the other forms). Every item's answer fits
    its task (items() leaves out those that do not), so a perfect model routes 100%."""
    reply = reply.strip()
    words = re.findall(r"[a-záéíóúñü]+", reply.lower())
    if task == "numbers":
        return bool(words) and set(words) <= NUMBER_WORDS
    if task == "sentiment":
        return reply in SENTIMENT.values()
    if task == "entities":
        return _ENTITY.fullmatch(reply) is not None
    if task == "speaker":
        return reply in (speakers if speakers is not None else hamlet_speakers())
    if not words or any(fits(t, reply, speakers) for t in ("numbers", "sentiment", "speaker", "entities")):
        return False
    english, spanish = sum(w in ENGLISH for w in words), sum(w in SPANISH for w in words)
    return spanish > english if task == "en-es" else english >= spanish


# --- the sources: (input, answer, wrong) rows per split ---------------------------------------------

@cache
def _sources(seed: int) -> dict[str, dict[str, list[tuple[str, str, str]]]]:
    def rng(corpus: str) -> random.Random:      # one stream per corpus: a size changed in one moves no other
        return random.Random(f"{NAME}-{seed}-{corpus}")

    bible = _bible(rng("bible"))
    speeches = _speeches(rng("hamlet"))
    sources = {"numbers": _numbers(rng("numbers")), "sentiment": _sentiment(rng("sentiment")),
               "en-es": bible[0], "es-en": bible[1], "entities": _entities(rng("entities")),
               "speaker": speeches[0], "continue": speeches[1]}
    held: dict[str, set[str]] = {}       # a text the corpus repeats stays in the first split that has it
    for split in ("test", "validation", "train"):
        kept = {}
        for task, rows in sources.items():
            texts = 2 if task in ("numbers", "en-es", "es-en", "continue") else 1   # answers that are texts too
            known = held.get(CORPUS.get(task, task), set())
            kept[task] = [r for r in rows[split] if not known & set(r[:texts])]
        for task, rows in kept.items():
            sources[task][split] = rows
            held.setdefault(CORPUS.get(task, task), set()).update(x for r in rows for x in r[:2])
    return sources


def _held_out(units: list, rng: random.Random, sizes: dict[str, int] = HELD_OUT) -> dict[str, list]:
    """Shuffle `units` and cut the held-out splits off the front; the rest trains."""
    units = list(units)
    rng.shuffle(units)
    out, start = {}, 0
    for split, n in sizes.items():
        out[split], start = units[start:start + n], start + n
    out["train"] = units[start:]
    return out


def _numbers(rng: random.Random) -> dict[str, list]:
    seen: set[int] = set()
    draw = {}
    for split, n in (*LARGE_HELD_OUT.items(), ("train", TRAIN_NUMBERS)):
        draw[split] = []
        while len(draw[split]) < n:     # digit counts 1..6 equally likely, never repeated
            draw[split].append(k := corpora.sample_training_number(rng, seen))
            seen.add(k)

    def row(n: int) -> tuple[str, str, str]:
        digits = list(str(n))
        i = rng.randrange(len(digits))
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and (i or d != "0" or len(digits) == 1)])
        fr, en = corpora.number_pair(n)
        return fr, en, corpora.number_pair(int("".join(digits)))[1]

    return {split: [row(n) for n in ns] for split, ns in draw.items()}


def _sentiment(rng: random.Random) -> dict[str, list]:
    data = corpora.rotten_tomatoes()
    rows = [(text, SENTIMENT[label], SENTIMENT["rotten" if label == "fresh" else "fresh"])
            for text, label in zip(data.texts, data.labels)]
    return _held_out(rows, rng, LARGE_HELD_OUT)


def _bible(rng: random.Random, longest: int = 120) -> tuple[dict[str, list], dict[str, list]]:
    """Verses of at most `longest` characters; whole chapters held out; half the chapters ask en->es, the
    other half es->en; TRAIN_VERSES of each direction's training chapters train. The wrong reply: the
    translation of the next verse of the chapter."""
    pairs = corpora.bible_en_es()
    chapters: dict[str, list[tuple[str, str]]] = {}
    for en, es, group in zip(pairs.sources, pairs.targets, pairs.groups):
        chapters.setdefault(group, []).append((en, es))
    names = sorted(chapters)
    rng.shuffle(names)
    directions = []
    for d in (0, 1):                           # 0: en -> es, 1: es -> en, on alternate chapters
        units = []
        for name in names[d::2]:
            turned = [v if d == 0 else v[::-1] for v in chapters[name]]   # (source, target) of this direction
            units.append([(x, y, wrong) for (x, y), (_, wrong) in zip(turned, turned[1:] + turned[:1])
                          if len(x) <= longest and len(y) <= longest and y != wrong])
        split = _held_out(units, rng, {s: n // 20 for s, n in HELD_OUT.items()})   # ~20 short verses a chapter
        rows = {s: [row for chapter in chs for row in chapter] for s, chs in split.items()}
        rows["train"] = rng.sample(rows["train"], min(TRAIN_VERSES, len(rows["train"])))
        directions.append(rows)
    return directions[0], directions[1]


def _entities(rng: random.Random) -> dict[str, list]:
    data = corpora.wnut16()
    types = sorted({t[2:] for labels in data.labels for t in labels if t != "O"})
    rows = []
    for words, labels in zip(data.words, data.labels):
        spans: list[tuple[str, list[str]]] = []
        for word, label in zip(words, labels):
            if label.startswith("B-") or (label.startswith("I-") and not spans):
                spans.append((label[2:], [word]))
            elif label.startswith("I-"):
                spans[-1][1].append(word)
        answer = "; ".join(f"{t}: {' '.join(ws)}" for t, ws in spans) or "none"
        wrong = ("; ".join(f"{rng.choice([x for x in types if x != t])}: {' '.join(ws)}" for t, ws in spans) if spans
                 else f"{rng.choice(types)}: {max(words, key=len)}")
        rows.append((" ".join(words), answer, wrong))
    return _held_out(rows, rng)


@cache
def _play() -> list[tuple[str, list[str]]]:
    """Hamlet's speeches as (speaker, lines): a speaker is a line in capitals; a speech is the lines under
    it up to the next blank line (after which come stage directions)."""
    speeches: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in read_text("hamlet").splitlines():
        text = line.strip()
        if re.fullmatch(r"[A-Z][A-Z ]+", text):
            current = []
            speeches.append((text.title(), current))
        elif not text:
            current = None
        elif current is not None:
            current.append(text)
    return [(s, lines) for s, lines in speeches if lines]


def hamlet_speakers(min_lines: int = 20) -> frozenset[str]:
    """The speakers with at least `min_lines` lines: the answers of the speaker task."""
    counts = Counter(speaker for speaker, lines in _play() for _ in lines)
    return frozenset(s for s, n in counts.items() if n >= min_lines)


def _speeches(rng: random.Random) -> tuple[dict[str, list], dict[str, list]]:
    """Speaker rows (a line of 20+ characters -> its speaker, a frequent one) and continue rows (a line ->
    the next line of its speech), whole speeches held out."""
    speakers = sorted(hamlet_speakers())
    every_line = [line for _, lines in _play() for line in lines if len(line) >= 20 and not line.startswith(STAGE)]
    units = []
    for speaker, lines in _play():
        who = [(line, speaker, rng.choice([s for s in speakers if s != speaker]))
               for line in lines if len(line) >= 20 and not line.startswith(STAGE) and speaker in speakers]
        follow = [(a, b, rng.choice(every_line)) for a, b in zip(lines, lines[1:])   # that line: replaced below,
                  if len(a) >= 20 and len(b) >= 15 and not b.startswith(STAGE)]    # the draw kept: it fixes the splits
        units.append((who, follow))
    split = _held_out(units, rng, {s: n // 4 for s, n in HELD_OUT.items()})   # ~4 long lines a speech
    return ({s: [r for who, _ in us for r in who] for s, us in split.items()},
            {s: _wrong_lines([follow for _, follow in us], rng) for s, us in split.items()})


def _wrong_lines(speeches: list[list[tuple[str, str, str]]], rng: random.Random) -> list[tuple[str, str, str]]:
    """One split's continue rows, the wrong reply the next line of another speech of the same split: a held-out
    item weighs two lines never trained on, not one against a memorised training line (which scores higher)."""
    draws = map(rng.choice, repeat([(k, b) for k, follow in enumerate(speeches) for _, b, _ in follow]))  # endless
    return [(a, b, next(line for j, line in draws if j != k and line != b))
            for k, follow in enumerate(speeches) for a, b, _ in follow]
