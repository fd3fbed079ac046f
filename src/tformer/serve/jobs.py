"""The handlers' side of the scheduler: a request's sequences (a Job), submitted, and answered whole
(JSON) or streamed (Server-Sent Events). A client that goes away cancels its sequences either way:
a stream notices when its generator is cancelled; a whole answer listens for the disconnect
while it waits."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import StreamingResponse

from .errors import RETRY_AFTER, ApiError, error_response
from .scheduler import Event, QueueFull, Sampling, Sequence
from .schemas import Sampled
from .state import State

CLIENT_CLOSED = 499         # nginx's status for "the client closed the connection" (counted, never seen)


class Job:
    """The sequences of one request and the asyncio queue the scheduler thread feeds."""

    def __init__(self, state: State, seqs_args: list[tuple[int, list[int], Sampling, list[int] | None]],
                 adapter: int = 0):
        self.state, self.queue = state, asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(event: Event) -> None:        # called on the scheduler's thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:                 # the event loop has closed: nobody is listening
                pass

        served = state.served
        self.seqs = [Sequence(i, prompt, s, served.output, served.eos, sink, source, served.device, adapter)
                     for i, prompt, s, source in seqs_args]

    def submit(self) -> None:
        try:
            self.state.scheduler.submit(self.seqs)
        except QueueFull as e:
            if self.state.draining or self.state.scheduler.stopping:
                raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down",
                               headers={"Retry-After": RETRY_AFTER}) from None
            raise ApiError(429, f"the server is busy: {e}", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": RETRY_AFTER}) from None

    async def events(self):
        """Events until every sequence is finished; leaving early (a client gone) cancels the rest."""
        left, failed = len(self.seqs), False
        try:
            while left:
                event: Event = await self.queue.get()
                if event.finish_reason is not None or event.error is not None:
                    left -= 1
                    failed = failed or event.error is not None
                yield event
        finally:
            if left:
                self.state.scheduler.cancel(self.seqs)
                if not failed:
                    self.state.metrics.cancelled.inc()


def start_job(state: State, body: Sampled, prompts: list[list[int]], max_tokens: int, logprobs: int | None,
              prompt_logprobs: bool = False, grammar=None, adapter: int = 0) -> Job:
    """One sequence per prompt and choice (choice k of a seeded request uses seed + k); `grammar` (a
    grammar.Compiled) constrains each of them (each has its own matcher); `adapter`: the LoRA adapter
    they use (0: the base)."""
    served, args = state.served, []
    bias = body.token_bias(served.model.cfg.vocab_size)
    for p, prompt in enumerate(prompts):
        for k in range(body.n):
            s = Sampling(max_tokens, body.temperature, body.top_p, body.top_k or None, body.min_p,
                         body.repetition_penalty, None if body.seed is None else (body.seed + k) % 2**63,
                         body.stops(), logprobs, body.frequency_penalty, body.presence_penalty, bias,
                         prompt_logprobs, grammar)
            source = prompt if served.model.is_encoder_decoder else None
            args.append((p * body.n + k, [served.start] if source else prompt, s, source))
    if served.model.is_encoder_decoder and served.start is None:
        raise ApiError(400, "the model config has no decoder start token (decoder_start_token_id, bos or pad)")
    state.metrics.tokens_in.inc(sum(map(len, prompts)))
    job = Job(state, args, adapter)
    job.submit()
    return job


async def respond(job: Job, fmt, body: Sampled, request: Request):
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(sse(job, fmt, usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    answer = asyncio.ensure_future(whole(job, fmt))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():       # the client went away (or this handler was cancelled)
            answer.cancel()         # Job.events() cancels the sequences: their rows leave before the next step
            await asyncio.wait({answer})
    if answer.cancelled():
        return error_response(CLIENT_CLOSED, "the client closed the connection", code="client_closed")
    return answer.result()


async def disconnected(request: Request) -> None:
    """Returns when the client has closed its connection (the request's body is already read, so
    the server's next message is the disconnect; Starlette's StreamingResponse listens the same way)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def whole(job: Job, fmt) -> dict:
    texts, tokens, reasons = {}, {}, {}
    async for event in job.events():
        if event.error is not None:
            raise ApiError(500, event.error, "server_error")
        texts[event.index] = texts.get(event.index, "") + event.text
        tokens.setdefault(event.index, []).extend((event.prompt or []) + event.tokens)
        if event.finish_reason is not None:
            reasons[event.index] = event.finish_reason
    return fmt.response([(i, texts.get(i, ""), tokens.get(i, []), reasons.get(i)) for i in range(len(job.seqs))],
                        sum(len(s.generated) for s in job.seqs))


async def sse(job: Job, fmt, include_usage: bool):
    """data: {chunk} lines, then data: [DONE]. A client that disconnects cancels this generator,
    and Job.events() then cancels its sequences."""
    for chunk in fmt.first_chunks():
        yield f"data: {json.dumps(chunk)}\n\n"
    async for event in job.events():
        if event.error is not None:
            yield f"data: {json.dumps({'error': {'message': event.error, 'type': 'server_error'}})}\n\n"
            break
        if event.text or event.tokens or event.prompt or event.finish_reason:
            chunk = fmt.chunk(event)          # None: held back (a text that may still become a tool call)
            if chunk is not None:
                yield f"data: {json.dumps(chunk)}\n\n"
    if include_usage:
        yield f"data: {json.dumps(fmt.usage_chunk(sum(len(s.generated) for s in job.seqs)))}\n\n"
    yield "data: [DONE]\n\n"
