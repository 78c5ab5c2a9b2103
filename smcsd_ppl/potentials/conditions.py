"""A program's per-token conditions, as constraints: each test applied once per vocabulary.

``extend(condition=test)`` asks that every token the block emits pass ``test(piece)``, where
``piece`` is the token's text. Applied to each token of the vocabulary once, the test becomes a
fixed mask, a hard ``Constraint``: the draft proposes only passing tokens, the target's bonus
is drawn among them, and the block's weight carries the mass both kept. Particles then follow
the target conditioned on every token passing, and none dies of a failing token; a condition
checked after the block (LLaMPPL's ``self.condition``) throws whole blocks away instead.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from .constraints import Constraint

REMEMBERED = 64  # tests (and their products with a constraint) a vocabulary keeps at once


class TokenCondition(Constraint):
    """Every token passes a fixed test of its text; EOS always may end the output.

    Args:
        passes: ``[V]`` bool, which tokens pass.
        eos_token_ids: the tokens that end an output (allowed after any passing context).
    """

    def __init__(self, passes: torch.Tensor, eos_token_ids: Sequence[int]) -> None:
        super().__init__(len(passes), eos_token_ids)
        self.passes = passes.clone()
        self.passes[list(self.eos_token_ids)] = True
        self._eos = frozenset(self.eos_token_ids)

    def next_mask(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The passing tokens ``[n, V]`` after each context that holds only passing text."""
        out = self.passes.repeat(len(contexts), 1)
        for n, context in enumerate(contexts):
            if not self._viable(context):
                out[n] = False
        return out

    def allows(self, sequences: Sequence[Sequence[int]]) -> list[bool]:
        """Whether every token passes, an EOS only at the end (no mask needed)."""
        return [not s or (self._viable(s[:-1]) and bool(self.passes[int(s[-1])])) for s in sequences]

    def _viable(self, context: Sequence[int]) -> bool:
        ids = [int(t) for t in context]
        return not (self._eos & set(ids)) and bool(self.passes[ids].all())


class AllOf(Constraint):
    """Two constraints at once: allowed where both allow, weighed by both (a product)."""

    def __init__(self, first: Constraint, second: Constraint) -> None:
        super().__init__(first.vocab_size or second.vocab_size, first.eos_token_ids or second.eos_token_ids)
        self.parts = (first, second)
        self.weighted = first.weighted or second.weighted

    def next_mask(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Where both allow."""
        a, b = (c.next_mask(contexts) for c in self.parts)
        return a & b.to(a.device)

    def next_log_weights(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The sum of both log-weights (-inf where either forbids)."""
        a, b = (c.next_log_weights(contexts) for c in self.parts)
        return a + b.to(a.device)

    def allows(self, sequences: Sequence[Sequence[int]]) -> list[bool]:
        """Where both allow."""
        a, b = (c.allows(sequences) for c in self.parts)
        return [x and y for x, y in zip(a, b)]

    def is_complete(self, context: Sequence[int]) -> bool:
        """Where both are complete."""
        return all(c.is_complete(context) for c in self.parts)


class Conditions:
    """The token conditions of one vocabulary: each test applied to every token once, remembered.

    A test is remembered by its code, defaults and captured values, so the same lambda written
    in a program's ``step`` is applied once for the pair, not once per step. It must therefore
    depend on the token's text alone.

    Args:
        pieces: gives each token's text, by id (read on the first condition); None for a
            special token, which no condition lets through (EOS aside).
        eos_token_ids: the tokens that end an output (they always pass).
    """

    def __init__(self, pieces: Callable[[], Sequence[str | None]], eos_token_ids: Sequence[int]) -> None:
        self._read_pieces, self._pieces = pieces, None
        self.eos_token_ids = tuple(eos_token_ids)
        self._made: OrderedDict = OrderedDict()

    def constraint(self, test: Callable[[str], object], also: Constraint | None = None) -> Constraint:
        """The condition ``test`` as a constraint; with ``also``, the two together."""
        if not callable(test):
            raise ValueError(f"a condition must be a function of a token's text, got {type(test).__name__}")
        key = _identity(test)
        condition = self._recall(key) or self._keep(key, TokenCondition(self._mask(test), self.eos_token_ids))
        if also is None:
            return condition
        both = self._recall((key, id(also)))
        if both is None or both.parts[0] is not also:  # the id of a constraint gone may be reused
            both = self._keep((key, id(also)), AllOf(also, condition))
        return both

    def _recall(self, key) -> Constraint | None:
        if key in self._made:
            self._made.move_to_end(key)
        return self._made.get(key)

    def _keep(self, key, made: Constraint) -> Constraint:
        self._made[key] = made
        while len(self._made) > REMEMBERED:
            self._made.popitem(last=False)
        return made

    def _mask(self, test: Callable[[str], object]) -> torch.Tensor:
        if self._pieces is None:
            self._pieces = list(self._read_pieces())
        out = []
        for i, piece in enumerate(self._pieces):
            try:
                out.append(piece is not None and bool(test(piece)))
            except Exception as err:  # noqa: BLE001 - the user's test: say where it failed
                raise ValueError(
                    f"the condition raised {type(err).__name__} on token {i} ({piece!r}): {err}"
                ) from None
        return torch.tensor(out, dtype=torch.bool)


def _identity(test: Callable) -> object:
    """What makes two tests the same: a function's code, defaults and captured values."""
    if isinstance(test, types.MethodType):
        return (_identity(test.__func__), id(type(test.__self__)))
    if not isinstance(test, types.FunctionType):
        return test
    cells = tuple(c.cell_contents for c in test.__closure__ or ())
    key = (test.__code__, test.__defaults__, cells)
    try:
        hash(key)
    except TypeError:  # a captured value that cannot be a key: this function object alone
        return test
    return key
