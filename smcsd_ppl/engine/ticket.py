"""A submitted request as its caller sees it: settled text as it comes, then the result.

The engine's outputs write a ticket (``apply``); callers read it from any thread (``wait``) or
any asyncio loop (``stream``, ``result``), and cancel it (which asks the engine to abort it).
The engine sends token ids; the ticket owns the text, as a client does: it decodes the ids
every surviving particle shares as they come (only what is new, ``text.IncrementalText``), and
it is the one place a text is cut at a stop string. What is streamed is cut before the first
stop string, and held back by one stop string's length less one character while a stop string
could still be forming: a stream never takes text back, and its pieces join into the final text.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from ..ends import FinishReason, before_stop, tokens_reaching
from ..results import Generation
from ..text import IncrementalText, whole_characters
from .core import Output, RequestCancelled

__all__ = ["RequestCancelled", "Ticket"]


class Ticket:
    """One request's handle: its streamed text, its outcome, and a way to cancel it.

    Attributes:
        id: the request's id.
        prompt_tokens: tokens in its prompt.
        completion_tokens: tokens in its output (final once done).
        finish_reason: why it ended (``ends.FinishReason``), None before it is done.
        population: its final population once it finished (in-process engines only).
    """

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        stop: Sequence[str] = (),
        abort: Callable[[str], None] | None = None,
        on_done: Callable[[Ticket], None] | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        """``decode``: token ids -> text, U+FFFD where bytes are not yet a character (None: no stream)."""
        self.id, self.prompt_tokens, self.stop = request_id, prompt_tokens, tuple(stop)
        self._text = IncrementalText(decode) if decode is not None else None  # the shared ids' text
        self._on_done = on_done
        self.completion_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.population = None
        self._abort = abort
        self._lock = threading.Lock()
        self._pieces: list[str] = []
        self._sent = ""  # the pieces joined
        self._done = threading.Event()
        self._outcome: Generation | BaseException | None = None
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # The engine's side.
    def apply(self, output: Output) -> None:
        """Take one engine output: newly settled ids, the result, or the failure."""
        if output.settled_ids and self._text is not None:
            self.offer(self._text.extend(output.settled_ids))
        if output.population is not None:
            self.population = output.population
        if output.error is not None:
            self.fail(output.error)
        elif output.result is not None:
            self.finish(output.result, output.reason)

    def offer(self, settled: str) -> None:
        """Stream what ``settled`` (text every surviving particle shares) adds, short of a stop."""
        text, stopped = before_stop(settled, self.stop)
        if not stopped and self.stop:
            text = text[: max(len(self._sent), len(text) - max(map(len, self.stop)) + 1)]
        self._add(text)

    def finish(self, generation: Generation, reason: FinishReason) -> None:
        """The request is done: its text, cut before a stop string, streams out in full, then its result.

        A finished output holding a stop string ends ``stop``, its tokens and log-probabilities
        where its text ends; a cancelled one stays ``cancelled``.
        """
        text, stopped = before_stop(generation.text, self.stop)
        if stopped:
            generation = self._cut(generation, text)
            reason = reason if reason is FinishReason.CANCELLED else FinishReason.STOP
        generation = replace(generation, text=text, finish_reason=str(reason))
        self._add(text)
        with self._lock:
            self.finish_reason, self.completion_tokens = reason, len(generation.token_ids)
            self._outcome = generation
        self._wake(done=True)

    def _cut(self, generation: Generation, text: str) -> Generation:
        """``generation`` with its tokens (and their log-probabilities) ending where ``text`` does."""
        if self._text is None:  # no decoder: the tokens cannot be matched to the text
            return generation
        decode = self._text.decode
        n = tokens_reaching(lambda ids: whole_characters(decode(ids)), generation.token_ids, len(text))
        logprobs = None if generation.logprobs is None else generation.logprobs[:n]
        return replace(generation, token_ids=generation.token_ids[:n], logprobs=logprobs)

    def fail(self, err: BaseException) -> None:
        """The request ends with ``err`` (raised by ``result`` and ``wait``)."""
        with self._lock:
            if self._done.is_set():
                return
            self._outcome = err
            if isinstance(err, RequestCancelled):
                self.finish_reason = FinishReason.CANCELLED
        self._wake(done=True)

    # The caller's side.
    def cancel(self) -> None:
        """Cancel the request: it leaves the batch at the next cycle boundary (nothing if done)."""
        if not self.done and self._abort is not None:
            self._abort(self.id)

    @property
    def done(self) -> bool:
        """Whether the request finished, failed or was cancelled."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Generation:
        """The result, blocking (``TimeoutError`` past ``timeout`` seconds)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        return self._result()

    async def result(self) -> Generation:
        """The result, from an asyncio loop."""
        while not self._done.is_set():
            await self._armed().wait()
        return self._result()

    async def stream(self) -> AsyncIterator[str]:
        """The text as it settles, piece by piece; ends when the request does."""
        n = 0
        while True:
            waker = self._armed()
            with self._lock:
                pieces, done = self._pieces[n:], self._done.is_set()
            for piece in pieces:
                yield piece
            n += len(pieces)
            if done:
                with self._lock:
                    rest = self._pieces[n:]
                for piece in rest:
                    yield piece
                return
            await waker.wait()

    def _result(self) -> Generation:
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def _add(self, text: str) -> None:
        with self._lock:
            if len(text) <= len(self._sent) or not text.startswith(self._sent):
                return
            self._pieces.append(text[len(self._sent) :])
            self._sent = text
        self._wake()

    def _armed(self) -> asyncio.Event:
        """An event of the running loop that the next change of this ticket sets."""
        event = asyncio.Event()
        with self._lock:
            if self._done.is_set():
                event.set()
            else:
                self._wakers.append((asyncio.get_running_loop(), event))
        return event

    def _wake(self, done: bool = False) -> None:
        with self._lock:
            if done:
                self._done.set()
            wakers, self._wakers = self._wakers, []
        for loop, event in wakers:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop has closed: nobody is listening there
                pass
        if done and self._on_done is not None:
            self._on_done(self)
