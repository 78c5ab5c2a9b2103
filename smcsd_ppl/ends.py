"""Where a row ends: the one rule every method applies to the tokens it emits."""

from __future__ import annotations

from collections.abc import Container, Sequence


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
