"""Future validity: the twist that turns a masked target into the target conditioned on a constraint.

Under a hard constraint the distribution asked for is p(y) phi(y) / Z, the target
conditioned on the whole output being valid. Masking each next token to the allowed ones
samples something else: the locally projected target, blind to how much probability the
completions after a token keep. The missing statistic is the future validity

    Phi(x) = sum over valid completions c of x of p(c | x)

(within the token budget; p^alpha when the target is raised to a power). The conditional
law is the Doob h-transform of p with h = Phi: token t follows x with probability
p(t | x) Phi(x t) / Phi(x), where Phi(x EOS) = 1 for a complete x. ``FutureValidity``
enters SMC-SD as a weighted constraint with exactly these factors, Phi(x t) / Phi(x) (the
first token's Phi(t) alone): the draft and the target's bonus draws are tilted by them,
and the weights carry them. Along a valid output they telescope to 1, so the twist
cancels at the end: the outputs' law and the evidence log Z are those of the untwisted
target whatever Phi is; the better Phi, the less the weights vary.

Phi is computed by dynamic programming over the constraint's masks and the target's
next-token law (``step``), which needs that law at any context: exact for a bounded
grammar on an enumerable target (a mock; ``depth=None``), a k-step lookahead estimate
otherwise (``depth=k``: the chance that the next k tokens stay allowed). On a real pair,
where each context costs a forward, the run's ``twist`` setting estimates Phi at each block's
end instead: through the finite structure ahead, read in one tree forward
(``inference.structure``; with ``"finite"``, only where that structure does not open into free
text), or one token ahead (``inference.lookahead``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .constraints import Constraint

MAX_CONTEXTS = 200_000  # contexts one dynamic programme may visit: past that it is not enumerable
NextLogWeights = Callable[[tuple[int, ...]], torch.Tensor]
"""Generated tokens -> the target's log-weight of every next token ``[V]`` (alpha log p_T)."""


class FutureValidity(Constraint):
    """A hard constraint twisted by its future validity Phi (the Doob h-transform of the target).

    The mask is the constraint's; the log-weight of token t after context x is
    log Phi(x t) - log Phi(x), with log Phi(x EOS) = 0 and Phi taken as 1 before the first
    token. One instance serves one prompt.

    Args:
        constraint: the hard constraint (its masks and EOS ids).
        step: the target's log-weights of the next token after each generated context.
        horizon: tokens an output may have, its EOS included (the run's ``max_new_tokens``):
            a context with no room left for a valid completion has Phi = 0.
        depth: None for the exact Phi; k for the k-step lookahead estimate.
    """

    weighted = True

    def __init__(
        self, constraint: Constraint, step: NextLogWeights, horizon: int, depth: int | None = None
    ) -> None:
        if constraint.weighted:
            raise ValueError("FutureValidity twists a hard constraint; this one is weighted")
        if depth is not None and depth < 1:
            raise ValueError(f"depth must be None (exact) or at least 1, got {depth!r}")
        super().__init__(constraint.vocab_size, constraint.eos_token_ids)
        self.constraint, self.step, self.horizon, self.depth = constraint, step, horizon, depth
        self._phi: dict[tuple[tuple[int, ...], int | None], float] = {}
        self._moves: dict[tuple[int, ...], list[tuple[int, float]]] = {}

    def next_mask(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The constraint's own masks."""
        return self.constraint.next_mask(contexts)

    def allows(self, sequences: Sequence[Sequence[int]]) -> list[bool]:
        """The constraint's own answer."""
        return self.constraint.allows(sequences)

    def next_log_weights(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Log Phi(x t) - log Phi(x) for every allowed t, -inf elsewhere (``[n, V]``)."""
        masks = self.next_mask(contexts)
        out = torch.full(masks.shape, -math.inf)
        for row, (context, mask) in enumerate(zip(contexts, masks)):
            x = tuple(int(t) for t in context)
            # At the start Phi is not divided out: the factors then telescope to 1, not to
            # 1 / Phi(empty), and the run's log Z stays the evidence log P(valid).
            here = self.log_phi(x) if x else 0.0
            if here == -math.inf:  # no valid completion fits: nothing may follow
                continue
            for t in mask.nonzero().flatten().tolist():
                out[row, t] = self.log_phi_after(x, t) - here
        return out

    def log_phi_after(self, context: tuple[int, ...], token: int) -> float:
        """Log Phi of ``context`` extended by ``token`` (0 for an EOS: the output is complete)."""
        return 0.0 if token in self.eos_token_ids else self.log_phi((*context, token))

    def log_phi(self, context: tuple[int, ...]) -> float:
        """Log Phi(context): exact, or the ``depth``-step lookahead."""
        return self._log_phi(context, self.depth)

    def _log_phi(self, x: tuple[int, ...], depth: int | None) -> float:
        if depth == 0:  # the lookahead ends here: assume the rest is valid
            return 0.0
        key = (x, depth)
        if key not in self._phi:
            deeper = None if depth is None else depth - 1
            terms = [
                w + (0.0 if t in self.eos_token_ids else self._log_phi((*x, t), deeper))
                for t, w in self._next(x)
            ]
            self._phi[key] = _log_sum_exp(terms)
        return self._phi[key]

    def _next(self, x: tuple[int, ...]) -> list[tuple[int, float]]:
        """The allowed next tokens of ``x`` that still fit the horizon, with their log-weights."""
        if x not in self._moves:
            if len(self._moves) >= MAX_CONTEXTS:
                raise ValueError(
                    f"future validity visits over {MAX_CONTEXTS} contexts here: the language and budget "
                    "are too large to enumerate; use twist='lookahead' (or FutureValidity(depth=k))"
                )
            if len(x) >= self.horizon:  # no token fits, not even an EOS
                self._moves[x] = []
            else:
                allowed = self.constraint.next_mask([x])[0].nonzero().flatten().tolist()
                log_w = self.step(x).double()
                self._moves[x] = [(t, float(log_w[t])) for t in allowed]
        return self._moves[x]


def _log_sum_exp(terms: list[float]) -> float:
    """Log sum exp of floats (-inf for none)."""
    top = max(terms, default=-math.inf)
    if top == -math.inf:
        return -math.inf
    return top + math.log(sum(math.exp(v - top) for v in terms))


def lm_step(lm, prompt: Sequence[int], temperature: float = 1.0, alpha: float = 1.0) -> NextLogWeights:
    """``step`` of an LM that reads its next-token logits for any context (``lm.next_logits``).

    The weights are alpha log p_T: what SMC-SD's target p_T^alpha gives each token.
    """
    head = list(prompt)
    return lambda x: alpha * torch.log_softmax(lm.next_logits(head + list(x)).double() / temperature, -1)


def enumerable(lm) -> bool:
    """Whether ``lm`` reads its next-token logits for any context (``next_logits``: a mock's table)."""
    return callable(getattr(lm, "next_logits", None))


class Twister:
    """What a run's programs twist their constraints with, under one set of settings.

    ``name`` is the run's ``SMCConfig.twist``. ``"future-validity"`` is exact where the target
    is enumerable (a ``FutureValidity`` per constraint and prompt, its dynamic programme
    shared by every particle); elsewhere ``exact`` is False and a program asks the cycle for
    an estimate at its blocks' ends instead: one token ahead (``"lookahead"``, and
    ``"future-validity"`` on a real target, where a forward's positions cost) or through the
    finite structure ahead (``structure``: ``"structure"``, and ``"finite"``, which reads it only
    where it does not open into free text: ``finite``).
    """

    def __init__(self, target, temperature: float, alpha: float, horizon: int, name: str) -> None:
        self.target, self.temperature, self.alpha, self.horizon = target, temperature, alpha, horizon
        self.exact = name == "future-validity" and enumerable(target)
        self.structure = name in ("structure", "finite")
        self.finite = name == "finite"
        self._twisted: dict[tuple[int, tuple[int, ...]], FutureValidity] = {}

    def twisted(self, constraint: Constraint, prompt: Sequence[int]) -> FutureValidity:
        """``constraint`` twisted by its exact future validity after ``prompt``."""
        key = (id(constraint), tuple(prompt))
        if key not in self._twisted:
            step = lm_step(self.target, prompt, self.temperature, self.alpha)
            self._twisted[key] = FutureValidity(constraint, step, self.horizon)
        return self._twisted[key]
