"""Instruction-tuning data: conversations read from JSONL, rendered with a chat template into token ids
and a per-token `trained` flag, and packed into rows (`tformer train --task sft`).

One example per line, either a conversation (OpenAI's messages) or a prompt and its completion (trl's
two formats):

    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}]}
    {"prompt": "2 + 2 =", "completion": " 4"}                          plain text: no template
    {"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", ...}]}   through the template

What is trained (the loss): a conversation's assistant messages; a completion. The end of each trained
turn (the template's end-of-turn token; EOS after a plain completion) is part of it, always: a model
that never sees it predicted never learns to stop. `train_on_prompt` trains every token.

Which tokens are the assistant's is found by rendering incrementally, for any template: message i's
text is what the conversation up to i adds to the prompt up to i - 1 with the generation prompt
(`render(m[:i+1]) - render(m[:i], add_generation_prompt=True)`), trailing whitespace left out (ChatML's
newline after <|im_end|>); a token is trained when its characters overlap that text (as transformers
marks the tokens of a `{% generation %}` block). A template that renders a prefix differently from the
whole conversation is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

from ..errors import DataError
from .chat_template import ChatTemplate
from .files import read_text

ROLES = ("system", "user", "assistant")
IGNORE = -100  # a label that is not trained (F.cross_entropy's ignore_index)
T = TypeVar("T")


@dataclass
class Example:
    """One line of the data: `messages` (a conversation; for prompt-completion lists, prompt + completion),
    or plain-text `prompt` and `completion`. `where` is "file:line" for error messages."""
    where: str
    messages: list[dict] | None = None
    prompt: str | list[dict] | None = None
    completion: str | list[dict] | None = None


@dataclass
class Rendered:
    ids: list[int]
    trained: list[bool]   # per token: predicted in the loss (an assistant reply and its end-of-turn)


def read_examples(path: str | os.PathLike) -> list[Example]:
    """The examples of a JSONL file, each checked (roles, an assistant turn): DataError "file:line: ..."."""
    return read_jsonl(path, parse_example)


def read_jsonl(path: str | os.PathLike, parse: Callable[[str, str], T]) -> list[T]:
    """`parse(line, "file:line")` of each non-blank line of a JSONL file; DataError when it has none."""
    path = Path(path)
    rows = [parse(line, f"{path}:{n}") for n, line in enumerate(read_text(path).splitlines(), 1) if line.strip()]
    if not rows:
        raise DataError(f"{path} has no examples")
    return rows


def json_object(line: str, where: str) -> dict:
    """One JSONL line's object; DataError "where: ..." when it is not valid JSON or not an object."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def parse_example(line: str, where: str) -> Example:
    obj = json_object(line, where)
    if "messages" in obj:
        messages = check_messages(obj["messages"], where, "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: the conversation has no assistant message (nothing to train on)")
        return Example(where, messages=messages)
    if "prompt" in obj and "completion" in obj:
        prompt, completion = obj["prompt"], obj["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return Example(where, prompt=prompt, completion=completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            prompt = check_messages(prompt, where, "prompt")
            completion = check_messages(completion, where, "completion")
            if not completion:
                raise DataError(f"{where}: the completion has no message (nothing to train on)")
            return Example(where, messages=prompt + completion, prompt=prompt, completion=completion)
        raise DataError(f"{where}: prompt and completion must both be strings or both lists of messages")
    raise DataError(f"{where}: expected {{\"messages\": [...]}} or {{\"prompt\": ..., \"completion\": ...}}, "
                    f"got the keys {', '.join(sorted(obj)) or 'none'}")


def check_messages(messages, where: str, key: str) -> list[dict]:
    if not isinstance(messages, list):
        raise DataError(f"{where}: {key} must be a list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {key} message {i} must be an object with a string content")
        if m.get("role") not in ROLES:
            raise DataError(f"{where}: {key} message {i} has the unknown role {m.get('role')!r} "
                            f"(use {', '.join(ROLES)})")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def template_reader(tokenizer):
    """A copy of `tokenizer`'s HF tokenizer that reads special tokens in text ("<|im_end|>", "<eos>"):
    a chat template writes them. (tformer's Tokenizer never does, so user text cannot forge them.)"""
    from tokenizers import Tokenizer as HFTokenizer

    reader = HFTokenizer.from_str(tokenizer.to_str())
    reader.encode_special_tokens = False
    reader.no_padding()
    reader.no_truncation()
    return reader


class Renderer:
    """Example -> Rendered: the template's text as token ids, and which of them are trained."""

    def __init__(self, tokenizer, template: ChatTemplate, train_on_prompt: bool = False):
        self.tokenizer, self.template, self.train_on_prompt = tokenizer, template, train_on_prompt
        self.reader = template_reader(tokenizer)

    def __call__(self, example: Example) -> Rendered:
        if example.messages is None:
            return self.plain(example)
        messages = example.messages
        full = self.render(messages, False, example)
        if example.completion is not None:                 # conversational prompt-completion: the completion
            turns = [(len(example.prompt), len(messages))]
        else:                                               # each assistant message
            turns = [(i, i + 1) for i, m in enumerate(messages) if m["role"] == "assistant"]
        spans = []
        for start, end in turns:
            before = self.render(messages[:start], True, example)
            through = self.render(messages[:end], False, example)
            if not (through.startswith(before) and full.startswith(through)):
                raise DataError(f"{example.where}: the chat template renders the first {end} messages differently "
                                "from the whole conversation, so the assistant's tokens cannot be found")
            spans.append((len(before), len(through.rstrip())))
        encoding = self.reader.encode(full, add_special_tokens=False)
        if self.train_on_prompt:
            return Rendered(encoding.ids, [True] * len(encoding.ids))
        trained = [any(s < e_span and e > s_span for s_span, e_span in spans) for s, e in encoding.offsets]
        return Rendered(encoding.ids, trained)

    def render(self, messages: list[dict], add_generation_prompt: bool, example: Example) -> str:
        try:
            return self.template.render(messages, add_generation_prompt)
        except ValueError as e:
            raise DataError(f"{example.where}: {e}") from None

    def plain(self, example: Example) -> Rendered:
        """Plain text, as trl: the completion starts where prompt and prompt + completion tokenize apart,
        and EOS follows it."""
        eos = self.tokenizer.eos_id
        if eos is None:
            raise DataError(f"{example.where}: the tokenizer has no EOS token to end the completion with")
        prompt = self.tokenizer.encode(example.prompt)
        ids = self.tokenizer.encode(example.prompt + example.completion) + [eos]
        common = next((i for i, (a, b) in enumerate(zip(prompt, ids)) if a != b), min(len(prompt), len(ids)))
        return Rendered(ids, [self.train_on_prompt or i >= common for i in range(len(ids))])


def pack(lengths: list[int], context: int) -> list[list[int]]:
    """Best-fit decreasing (trl's packing): indices of `lengths` grouped into rows of at most `context`
    tokens; each goes, longest first, into the fullest row it fits. Deterministic."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [r for r in range(len(rows)) if room[r] >= lengths[i]]
        if fits:
            best = min(fits, key=lambda r: room[r])
            rows[best].append(i)
            room[best] -= lengths[i]
        else:
            rows.append([i])
            room.append(context - lengths[i])
    return rows


def collate(rows: list[list[Rendered]], pad_id: int) -> dict[str, Tensor]:
    """Rows of conversations -> (B, T) tensors, T the longest row:

        input_ids   the tokens, conversations one after another, then pad_id
        labels      the next token where it is trained and in the same conversation, else IGNORE
        positions   0, 1, ... restarting at each conversation (each sees the positions it would alone)
        segments    1, 2, ... per conversation, 0 on padding: attention stays within a conversation
                    (model.masks.segment_mask)
    """
    width = max(sum(len(r.ids) for r in row) for row in rows)
    shape = (len(rows), width)
    ids, labels = torch.full(shape, pad_id), torch.full(shape, IGNORE)
    positions, segments = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for s, r in enumerate(row, 1):
            n = len(r.ids)
            tokens = torch.tensor(r.ids)
            ids[b, at:at + n] = tokens
            trained = torch.tensor(r.trained[1:], dtype=torch.bool)
            labels[b, at:at + n - 1] = torch.where(trained, tokens[1:], IGNORE)
            positions[b, at:at + n] = torch.arange(n)
            segments[b, at:at + n] = s
            at += n
    return {"input_ids": ids, "labels": labels, "positions": positions, "segments": segments}
