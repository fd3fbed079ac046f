"""An assistant scored on tformer-instruct's held-out items (`tformer eval --model RUN --data tformer-instruct`):

    routing              the share of replies that have the form of the task asked (tformer.data.instruct.fits)
    numbers_exact_match  French numbers put into English words exactly
    sentiment_accuracy   "positive" / "negative" equal to the review's label
    preference_accuracy  the share of items whose reference reply the model scores above the plausible wrong
                         one (the sum of the reply's token log-probabilities, its end-of-turn included)

and each of them per task (`routing/numbers`, ...). Replies are greedy, up to the template's end of turn;
prompts are rendered as the server renders a chat request, and batched (left-padded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.chat import Example, Renderer
from ..data.chat_template import ChatTemplate
from ..data.instruct import Item, fits, hamlet_speakers
from ..data.tokenizers import Tokenizer

MAX_REPLY = 64     # tokens: the longest reference (a 120-character verse) is about 40


def score(model: nn.Module, tokenizer: Tokenizer, template: ChatTemplate, items: list[Item],
          batch_size: int = 32) -> dict[str, float]:
    """The figures above over `items`; `model` is put in eval mode."""
    model.eval()
    renderer = Renderer(tokenizer, template)
    replies = answers(model, renderer, items, batch_size)
    preferred = preferences(model, renderer, items, batch_size)
    speakers = hamlet_speakers()
    per_item = {
        "routing": [fits(item.task, reply, speakers) for item, reply in zip(items, replies)],
        "exact": [reply.strip() == item.answer for item, reply in zip(items, replies)],
        "preference": preferred,
    }
    out: dict[str, float] = {}
    for name, values in per_item.items():
        for task in sorted({item.task for item in items}):
            picked = [v for v, item in zip(values, items) if item.task == task]
            out[f"{name}/{task}"] = sum(picked) / len(picked)
    out["routing"] = sum(per_item["routing"]) / len(items)
    out["preference_accuracy"] = sum(preferred) / len(items)
    for name, task in (("numbers_exact_match", "numbers"), ("sentiment_accuracy", "sentiment")):
        if f"exact/{task}" in out:
            out[name] = out[f"exact/{task}"]
    return dict(sorted(out.items()))


def answers(model: nn.Module, renderer: Renderer, items: list[Item], batch_size: int = 32) -> list[str]:
    """Each item's greedy reply (decoded, without the end of turn), in the order of `items`."""
    from ..generation import generate

    stops = sorted(end_of_turn(renderer, items))
    prompts = [renderer.reader.encode(renderer.render(item.messages(), True, example(item)),
                                      add_special_tokens=False).ids for item in items]
    order = sorted(range(len(items)), key=lambda i: len(prompts[i]))
    device = next(model.parameters()).device
    pad = renderer.tokenizer.pad_id if renderer.tokenizer.pad_id is not None else 0
    out: list[str] = [""] * len(items)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(chunk):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        room = min(MAX_REPLY, model.cfg.max_seq_len - width)
        new = generate(model, ids.to(device), mask.to(device), max_new_tokens=room, do_sample=False,
                       eos_token_id=stops)[:, width:]
        for row, i in enumerate(chunk):
            tokens = new[row].tolist()
            cut = next((k for k, t in enumerate(tokens) if t in stops), len(tokens))
            out[i] = renderer.tokenizer.decode(tokens[:cut])
    return out


def preferences(model: nn.Module, renderer: Renderer, items: list[Item], batch_size: int = 32) -> list[bool]:
    """Per item: whether the model gives the reference reply a higher log-probability than the wrong one."""
    sides = [[renderer(example(item, reply)) for reply in (item.answer, item.wrong)] for item in items]
    flat = [r for pair in sides for r in pair]
    logps: list[float] = []
    with torch.no_grad():
        for start in range(0, len(flat), batch_size):
            logps += reply_logprobs(model, flat[start:start + batch_size]).tolist()
    return [logps[2 * i] > logps[2 * i + 1] for i in range(len(items))]


def reply_logprobs(model: nn.Module, rendered: list) -> Tensor:
    """The sum over each rendered example's trained tokens of log p(token | what precedes it)."""
    device = next(model.parameters()).device
    width = max(len(r.ids) for r in rendered)
    ids = torch.zeros((len(rendered), width), dtype=torch.long)
    trained = torch.zeros((len(rendered), width), dtype=torch.bool)
    for row, r in enumerate(rendered):                   # right-padded: causal attention never sees the pad
        ids[row, :len(r.ids)] = torch.tensor(r.ids)
        trained[row, :len(r.ids)] = torch.tensor(r.trained)
    ids, trained = ids.to(device), trained.to(device)
    logp = F.log_softmax(model(ids)[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return (logp * trained[:, 1:]).sum(-1).cpu()


def end_of_turn(renderer: Renderer, items: list[Item]) -> set[int]:
    """The token ids that end a rendered reply (the template's end of turn)."""
    stops = set()
    for item in items[:16]:
        r = renderer(example(item, item.answer))
        last = max(i for i, t in enumerate(r.trained) if t)
        stops.add(r.ids[last])
    return stops


def example(item: Item, reply: str | None = None) -> Example:
    """The item as a conversation: its prompt, and `reply` as the assistant's turn if given."""
    return Example(f"tformer-instruct {item.task} item", messages=item.messages(reply))
