"""Response bodies of the generating endpoints, as OpenAI's: whole (JSON) or in chunks (SSE)."""

from __future__ import annotations

import time
import uuid

from .scheduler import Event


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_names(token, as_ids: bool) -> tuple[str, list[str]]:
    """How logprobs name a token and its alternatives: their text, or "token_id:{id}" (vLLM's
    return_tokens_as_token_ids)."""
    if not as_ids:
        return token.text, [text for text, _ in token.top or []]
    return f"token_id:{token.id}", [f"token_id:{i}" for i in token.top_ids or []]


class CompletionFormat:
    """Bodies of /v1/completions: object "text_completion", choices with text (and logprobs)."""

    def __init__(self, model: str, n: int, echo: list[str], prompt_tokens: int, echo_logprobs: bool = False,
                 as_ids: bool = False):
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.model, self.n, self.echo, self.prompt_tokens = model, n, echo, prompt_tokens
        self.echo_logprobs = echo_logprobs      # the echoed prompt comes with its tokens' logprobs, after prefill
        self.as_ids = as_ids                    # tokens named "token_id:{id}"
        self.offsets: dict[int, int] = {}

    def _body(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    def _logprobs(self, index: int, tokens) -> dict | None:
        """OpenAI's legacy logprobs of `tokens` (with echo + logprobs, the prompt's first: the first
        of them has logprob and top_logprobs null); text_offset counts on from the choice's last chunk."""
        if not tokens:
            return None
        start = 0 if self.echo_logprobs else len(self.echo[index // self.n])
        offsets, at = [], self.offsets.get(index, start)
        for t in tokens:
            offsets.append(at)
            at += len(t.text)
        self.offsets[index] = at
        names = [token_names(t, self.as_ids) for t in tokens]
        return {"tokens": [name for name, _ in names], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [None if t.top is None else dict(zip(alts, (lp for _, lp in t.top)))
                                 for t, (_, alts) in zip(tokens, names)], "text_offset": offsets}

    def first_chunks(self) -> list[dict]:
        if self.echo_logprobs:                  # the echo waits for its logprobs: chunk() sends both
            return []
        return [self._body([{"index": i, "text": e, "logprobs": None, "finish_reason": None}])
                for i in range(len(self.echo) * self.n) if (e := self.echo[i // self.n])]

    def chunk(self, event: Event) -> dict:
        echo = self.echo[event.index // self.n] if event.prompt is not None else ""
        return self._body([{"index": event.index, "text": echo + event.text,
                            "logprobs": self._logprobs(event.index, (event.prompt or []) + event.tokens),
                            "finish_reason": event.finish_reason}])

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {**self._body([]), "usage": usage(self.prompt_tokens, completion_tokens)}

    def response(self, choices, completion_tokens: int) -> dict:
        return {**self._body([{"index": i, "text": self.echo[i // self.n] + text,
                               "logprobs": self._logprobs(i, tokens) if tokens else None, "finish_reason": reason}
                              for i, text, tokens, reason in choices]),
                "usage": usage(self.prompt_tokens, completion_tokens)}


class ChatFormat:
    """Bodies of /v1/chat/completions: messages and deltas from the assistant. With `tools` that can be
    called (structured.Tools), an answer that is a call comes back as tool_calls; streamed, such an
    answer is held back until it is complete and sent as one delta."""

    def __init__(self, model: str, prompt_tokens: int, tools=None, as_ids: bool = False):
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.model, self.prompt_tokens, self.as_ids = model, prompt_tokens, as_ids
        self.tools = tools if tools is not None and tools.reads_calls else None
        self.started: set[int] = set()
        self.held: dict[int, tuple[str, list]] = {}     # choice -> (text, tokens) not yet sent
        self.released: set[int] = set()                 # choices known to be plain text

    def _body(self, choices: list[dict], obj: str = "chat.completion.chunk") -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, tokens) -> dict | None:
        def entry(name: str, text: str, logprob: float) -> dict:
            return {"token": name, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        if not tokens:
            return None
        content = []
        for t in tokens:
            name, alts = token_names(t, self.as_ids)
            content.append({**entry(name, t.text, t.logprob),
                            "top_logprobs": [entry(alt, a, lp) for alt, (a, lp) in zip(alts, t.top or [])]})
        return {"content": content}

    def _calls(self, text: str, reason: str | None) -> list[dict] | None:
        return self.tools.calls(text) if self.tools is not None and reason == "stop" else None

    def first_chunks(self) -> list[dict]:
        return []

    def chunk(self, event: Event) -> dict | None:
        """The chunk of `event`; None while a choice's text is held back (it may still become a call)."""
        text, tokens, reason = event.text, event.tokens, event.finish_reason
        if self.tools is not None and event.index not in self.released:
            held_text, held_tokens = self.held.pop(event.index, ("", []))
            text, tokens = held_text + text, held_tokens + tokens
            if reason is None and self.tools.may_be_call(text):
                self.held[event.index] = (text, tokens)
                return None
            self.released.add(event.index)
        delta = {"content": text} if text else {}
        calls = self._calls(text, reason)
        if calls is not None:
            delta = {"content": None, "tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
            reason = "tool_calls"
        if event.index not in self.started:
            self.started.add(event.index)
            delta = {"role": "assistant", "content": text, **delta}
        return self._body([{"index": event.index, "delta": delta, "logprobs": self._logprobs(tokens),
                            "finish_reason": reason}])

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {**self._body([]), "usage": usage(self.prompt_tokens, completion_tokens)}

    def _choice(self, i: int, text: str, tokens, reason: str | None) -> dict:
        calls = self._calls(text, reason)
        message = ({"role": "assistant", "content": text} if calls is None else
                   {"role": "assistant", "content": None, "tool_calls": calls})
        return {"index": i, "message": message, "logprobs": self._logprobs(tokens),
                "finish_reason": reason if calls is None else "tool_calls"}

    def response(self, choices, completion_tokens: int) -> dict:
        return {**self._body([self._choice(*c) for c in choices], "chat.completion"),
                "usage": usage(self.prompt_tokens, completion_tokens)}
