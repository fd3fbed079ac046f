"""Response bodies of the generating endpoints, as OpenAI's: whole (JSON) or in chunks (SSE)."""

from __future__ import annotations

import time
import uuid

from .scheduler import Event


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class CompletionFormat:
    """Bodies of /v1/completions: object "text_completion", choices with text (and logprobs)."""

    def __init__(self, model: str, n: int, echo: list[str], prompt_tokens: int, echo_logprobs: bool = False):
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.model, self.n, self.echo, self.prompt_tokens = model, n, echo, prompt_tokens
        self.echo_logprobs = echo_logprobs      # the echoed prompt comes with its tokens' logprobs, after prefill
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
        return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [None if t.top is None else dict(t.top) for t in tokens], "text_offset": offsets}

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
    """Bodies of /v1/chat/completions: messages and deltas from the assistant."""

    def __init__(self, model: str, prompt_tokens: int):
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.model, self.prompt_tokens = model, prompt_tokens
        self.started: set[int] = set()

    def _body(self, choices: list[dict], obj: str = "chat.completion.chunk") -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    @staticmethod
    def _logprobs(tokens) -> dict | None:
        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        if not tokens:
            return None
        return {"content": [{**entry(t.text, t.logprob), "top_logprobs": [entry(a, lp) for a, lp in t.top]}
                            for t in tokens]}

    def first_chunks(self) -> list[dict]:
        return []

    def chunk(self, event: Event) -> dict:
        delta = {"content": event.text} if event.text else {}
        if event.index not in self.started:
            self.started.add(event.index)
            delta = {"role": "assistant", **delta, "content": event.text}
        return self._body([{"index": event.index, "delta": delta, "logprobs": self._logprobs(event.tokens),
                            "finish_reason": event.finish_reason}])

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {**self._body([]), "usage": usage(self.prompt_tokens, completion_tokens)}

    def response(self, choices, completion_tokens: int) -> dict:
        return {**self._body([{"index": i, "message": {"role": "assistant", "content": text},
                               "logprobs": self._logprobs(tokens), "finish_reason": reason}
                              for i, text, tokens, reason in choices], "chat.completion"),
                "usage": usage(self.prompt_tokens, completion_tokens)}
