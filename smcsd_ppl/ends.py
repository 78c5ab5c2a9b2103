"""Where an output ends, and why: the one rule every method applies to the tokens it emits."""

from __future__ import annotations

import enum
from collections.abc import Callable, Container, Sequence


class FinishReason(str, enum.Enum):
    """Why an output ended (its value is what records and the command line show).

    ``STOP``: a stop string (the text ends before it), or the program ended it; ``EOS``: an
    end-of-sequence token; ``LENGTH``: the ``max_new_tokens`` budget; ``CONSTRAINT``: the
    constraint was complete (it allowed the end, or nothing more); ``CANCELLED``: its caller (or
    a closing server) cancelled it; ``ERROR``: it failed, or no particle survived (the
    ``message`` says why).
    """

    STOP = "stop"
    EOS = "eos"
    LENGTH = "length"
    CONSTRAINT = "constraint"
    CANCELLED = "cancelled"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value

    @property
    def openai(self) -> str:
        """The reason in OpenAI's words: ``length``, ``abort`` (cancelled, as vLLM), ``error``, else ``stop``.

        A server answers a request that failed with an error (HTTP 500, or an error event), not
        a choice: ``"error"`` is what one would read were it ever sent.
        """
        names = {FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort", FinishReason.ERROR: "error"}
        return names.get(self, "stop")


def row_ends(token: int | None, emitted: int, budget: int, eos: Container[int]) -> bool:
    """Whether a row ends with ``token``, its ``emitted``-th new token.

    It ends at an EOS id, once ``budget`` tokens are out, or when there is no token to
    emit (``None``: nothing left that may be drawn).
    """
    return token is None or token in eos or emitted >= budget


def first_end(tokens: Sequence[int], emitted: int, budget: int, eos: Container[int]) -> int | None:
    """How many of ``tokens`` a row emits before it ends among them (None: it goes on).

    ``emitted`` tokens came before them.
    """
    return next(
        (j + 1 for j, t in enumerate(tokens) if row_ends(t, emitted + j + 1, budget, eos)),
        None,
    )


def before_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string (excluded), and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def tokens_reaching(text_of: Callable[[Sequence[int]], str], ids: Sequence[int], length: int) -> int:
    """The fewest of ``ids`` whose text holds ``length`` characters: where a text cut there ends.

    A token whose text crosses the cut is kept (it carries the text's last characters).
    """
    lo, hi = 0, len(ids)
    while lo < hi:  # a prefix's text grows with it
        mid = (lo + hi) // 2
        if len(text_of(ids[:mid])) >= length:
            hi = mid
        else:
            lo = mid + 1
    return lo


def finish_reason(
    ids: Sequence[int], budget: int, eos: Container[int], *, stopped: bool = False, constrained: bool = False
) -> FinishReason:
    """Why an output of token ids ended, by the rule above (a stop string, when ``stopped``, first).

    Under a constraint, an end token (or no token left to draw) means the constraint was
    complete. Short of the budget with neither, the program itself ended the output.
    """
    if stopped:
        return FinishReason.STOP
    if ids and ids[-1] in eos:
        return FinishReason.CONSTRAINT if constrained else FinishReason.EOS
    if len(ids) >= budget:
        return FinishReason.LENGTH
    return FinishReason.CONSTRAINT if constrained else FinishReason.STOP
