"""Server-sent events of one HTTP request's choices, as their tickets settle text.

A ticket's stream gives only text every surviving particle already shares, so a piece once sent
is never taken back, and the pieces of a choice add up to its final text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from .errors import GenerationFailed
from .responses import Answer, request_usage

DONE = "data: [DONE]\n\n"


def event(data: dict) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response that runs ``on_close`` however it ends, a client gone included."""

    def __init__(
        self, events: AsyncIterator[str], on_close: Callable[[], None], headers: dict | None = None
    ) -> None:
        headers = {"Cache-Control": "no-cache"} | (headers or {})
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        """Send the events; then, finished or cut off, ``on_close``."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class ChoiceStreams:
    """The tickets of one request's choices, merged into one stream of chunks in OpenAI's format.

    Args:
        answer: the request's id, kind and model.
        tickets: one per choice, in choice order (prompt-major).
        n: choices per prompt.
        requests: each choice's ``ServeRequest`` (for its ``smcsd`` diagnostics).
        include_usage: usage in a chunk of its own after the choices (``stream_options``); otherwise
            in the last choice's final chunk.
        fields: ``(Generation, ServeRequest) -> dict``, the fields a choice's last chunk carries
            once its request finished (``smcsd``, ``logprobs``).
        failure: an exception -> the ``APIError`` a failed choice reports.
    """

    def __init__(self, answer: Answer, tickets, n: int, requests, include_usage: bool, fields, failure):
        self.answer, self.tickets, self.n, self.requests = answer, list(tickets), n, list(requests)
        self.include_usage, self.fields, self.failure = include_usage, fields, failure
        self.finished: set[int] = set()
        self.pumps: list[asyncio.Task] = []

    async def events(self) -> AsyncIterator[str]:
        """Role chunks, then every choice's pieces as they settle, its final chunk, usage, ``[DONE]``."""
        queue: asyncio.Queue = asyncio.Queue()
        self.pumps = [asyncio.create_task(self._pump(i, t, queue)) for i, t in enumerate(self.tickets)]
        if self.answer.kind == "chat":
            for i in range(len(self.tickets)):
                yield event(self.answer.chunk(i, "", first=True))
        while len(self.finished) < len(self.tickets):
            index, item = await queue.get()
            if isinstance(item, str):
                if self.answer.tool is None or self.answer.tool.named is not None:  # else: whole at the end
                    yield event(self.answer.chunk(index, item))
            elif isinstance(item, BaseException):
                self.finished.add(index)
                yield event(self.failure(item).body())
                return  # the others are cancelled on close
            else:
                self.finished.add(index)
                yield event(self._final(index, item))
        if self.include_usage:
            yield event(self.answer.usage_chunk(self._usage()))
        yield DONE

    def _final(self, index: int, gen) -> dict:
        """A choice's last chunk: its finish reason and diagnostics (the ticket streamed all its text)."""
        last = self.answer.chunk(
            index,
            "",
            finish_reason=self.tickets[index].finish_reason.openai,
            whole=gen.text,
            **self.fields(gen, self.requests[index]),
        )
        if not self.include_usage and len(self.finished) == len(self.tickets):
            last["usage"] = self._usage()
        return last

    def _usage(self) -> dict:
        return request_usage(self.tickets, self.n)

    @staticmethod
    async def _pump(index: int, ticket, queue: asyncio.Queue) -> None:
        try:
            async for piece in ticket.stream():
                if piece:
                    await queue.put((index, piece))
            gen = await ticket.result()
            if gen.finish_reason == "error":  # it ran and failed: an error event, never a "stop"
                raise GenerationFailed(gen.message)
            await queue.put((index, gen))
        except Exception as err:  # a failed or cancelled request: the stream reports it
            await queue.put((index, err))

    def close(self) -> None:
        """Cancel every choice not finished (a client gone) and stop reading their tickets."""
        for i, ticket in enumerate(self.tickets):
            if i not in self.finished:
                ticket.cancel()
        for pump in self.pumps:
            pump.cancel()
