"""Grammar-conditional exactness, by exact enumeration: SMC-SD against locally masked decoding.

A decoder that masks each next token to the ones a grammar still allows (AR or speculative
decoding under the mask, as serving engines do) samples the *locally projected*
distribution: at every step the target restricted to allowed tokens and renormalized,
blind to how much probability the completions after that token keep. The distribution
the constraint asks for is the target conditioned on the whole output being valid,
p(y) phi(y) / Z. SMC-SD's weights carry the masked-away mass, so its returned outputs
approach the latter as N grows.

The cases (``GRAMMARS``), each a mock target over four tokens (the last is EOS) with a
perturbed copy as draft:

* ``dyck``: a target that likes to open brackets and dislikes closing them, and the
  language of balanced brackets of at most ``MAX_LENGTH`` tokens (``a`` never allowed).
  Masked locally, the model opens deep and is then forced through closing brackets it
  would rarely write; conditioned globally, short outputs win.
* ``garden``: a finite automaton with a garden path: outputs are ``a b b b`` or one to five
  ``c``; the target likes to start with ``a`` and dislikes ``b``, so masking takes the path
  and is then forced down it.

Both distributions are enumerated exactly; SMC-SD's returned outputs (``result.token_ids``)
are counted over many seeded runs, with or without a future-validity twist
(``SMCConfig.twist``, or ``depth-k``: Phi estimated k tokens ahead, below).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..backends.mock import MockLM
from ..config import DraftRecord, SMCConfig
from ..ends import FinishReason
from ..engine.client import Engine
from ..inference.program import SMCSDModel
from ..inference.rows import RowStore
from ..potentials import Constraint
from ..potentials.twist import FutureValidity, lm_step

OPEN, CLOSE, OTHER, EOS = 0, 1, 2, 3
V, MAX_LENGTH, PROMPT = 4, 6, (2, 2)
HORIZON = MAX_LENGTH + 1  # every valid output fits, its EOS included


class BalancedBrackets(Constraint):
    """Non-empty balanced ``(``/``)`` strings of at most ``max_length`` tokens; EOS once balanced."""

    def __init__(self, max_length: int = MAX_LENGTH) -> None:
        super().__init__(V, [EOS])
        self.max_length = max_length

    def depth(self, context: Sequence[int]) -> int | None:
        """Open brackets after ``context``; None once it cannot become a valid output."""
        depth = 0
        for t in context:
            depth += {OPEN: 1, CLOSE: -1}.get(int(t), -math.inf)
            if depth < 0:
                return None
        return depth if depth + len(context) <= self.max_length else None

    def next_mask(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """``(`` while it can still be closed in time, ``)`` when open, EOS when balanced."""
        out = torch.zeros(len(contexts), V, dtype=torch.bool)
        for i, c in enumerate(contexts):
            d = self.depth(c)
            if d is None:
                continue
            out[i, OPEN] = d + 1 + len(c) + 1 <= self.max_length
            out[i, CLOSE] = d > 0
            out[i, EOS] = d == 0 and len(c) > 0
        return out


class FiniteAutomaton(Constraint):
    """The language of a deterministic automaton over the mock's tokens, at most ``max_length`` long.

    Args:
        transitions: (state, token) -> next state; the start state is 0.
        accepting: states where an output may end (EOS allowed).
        max_length: tokens an output may have before its EOS.
    """

    def __init__(self, transitions: dict[tuple[int, int], int], accepting: set[int], max_length: int) -> None:
        super().__init__(V, [EOS])
        self.transitions, self.accepting, self.max_length = transitions, accepting, max_length

    def state(self, context: Sequence[int]) -> int | None:
        """The state after ``context`` (None: off the automaton)."""
        state = 0
        for t in context:
            state = self.transitions.get((state, int(t)))
            if state is None:
                return None
        return state

    def next_mask(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Tokens with a transition (while the length allows one more), EOS in accepting states."""
        out = torch.zeros(len(contexts), V, dtype=torch.bool)
        for i, c in enumerate(contexts):
            state = self.state(c)
            if state is None:
                continue
            if len(c) < self.max_length:
                for (s, t), _ in self.transitions.items():
                    out[i, t] |= s == state
            out[i, EOS] = state in self.accepting and len(c) > 0
        return out


def garden_path() -> FiniteAutomaton:
    """``a b b b``, or one to five ``c`` (tokens 0 = a, 1 = b, 2 = c)."""
    a, b, c = OPEN, CLOSE, OTHER
    return FiniteAutomaton({(0, a): 1, (1, b): 2, (2, b): 3, (3, b): 4, (0, c): 5, (5, c): 5}, {4, 5}, 5)


def dyck_pair(seed: int = 0, noise: float = 0.8) -> tuple[MockLM, MockLM]:
    """A target that prefers ``(`` to ``)``, and a draft that is a perturbed copy of it."""
    return _pair(seed, noise, {OPEN: 1.0, CLOSE: -0.5})


def garden_pair(seed: int = 0, noise: float = 0.8) -> tuple[MockLM, MockLM]:
    """A target that likes ``a`` and dislikes ``b``, and a draft that is a perturbed copy of it."""
    return _pair(seed, noise, {OPEN: 1.5, CLOSE: -1.0})


def _pair(seed: int, noise: float, bias: dict[int, float]) -> tuple[MockLM, MockLM]:
    """A random order-2 target with its logits shifted by ``bias``, and a perturbed copy as draft."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(V, V, V, generator=g)
    for token, shift in bias.items():
        table[..., token] += shift
    target = MockLM(table=table)
    draft = MockLM(table=table + noise * torch.randn(table.shape, generator=g))
    return target, draft


GRAMMARS = {"dyck": (BalancedBrackets, dyck_pair), "garden": (garden_path, garden_pair)}
"""Each case: (the constraint's factory, the mock pair's factory from a seed)."""


def _outputs(target: MockLM, constraint: Constraint, local: bool) -> dict[tuple[int, ...], float]:
    """Probability of every valid output: under p x phi (unnormalized) or the local projection."""
    out: dict[tuple[int, ...], float] = {}

    def walk(seq: tuple[int, ...], weight: float) -> None:
        p = torch.softmax(target.next_logits(list(PROMPT) + list(seq)).double(), -1)
        mask = constraint.next_mask([seq])[0]
        mass = float(p[mask].sum()) if local else 1.0
        for t in mask.nonzero().flatten().tolist():
            w = weight * float(p[t]) / mass
            if t == EOS:
                out[seq + (EOS,)] = w
            else:
                walk(seq + (t,), w)

    walk((), 1.0)
    return out


def exact_distributions(target: MockLM, constraint: Constraint) -> tuple[dict, dict, float]:
    """The grammar-conditional distribution, the locally projected one, and Z = P_p(valid)."""
    joint = _outputs(target, constraint, local=False)
    z = sum(joint.values())
    return {y: w / z for y, w in joint.items()}, _outputs(target, constraint, local=True), z


def total_variation(p: dict, q: dict) -> float:
    """TV between two distributions given as {outcome: probability}."""
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def sampling_noise(dist: dict, runs: int, seed: int, repeats: int = 50) -> float:
    """The mean TV between ``dist`` and the empirical distribution of ``runs`` draws from it."""
    g = torch.Generator().manual_seed(seed)
    keys = list(dist)
    probs = torch.tensor([dist[k] for k in keys], dtype=torch.float64)
    tvs = []
    for _ in range(repeats):
        counts = Counter(torch.multinomial(probs, runs, replacement=True, generator=g).tolist())
        tvs.append(total_variation(dist, {keys[i]: c / runs for i, c in counts.items()}))
    return sum(tvs) / repeats


def returned_outputs(
    target: MockLM,
    draft: MockLM,
    *,
    n: int,
    mode: str,
    runs: int,
    seed: int,
    alone: bool = False,
    constraint: Constraint | None = None,
    **cfg,
) -> dict[tuple[int, ...], float]:
    """Empirical distribution of SMC-SD's returned outputs over ``runs`` requests.

    A request whose particles all died returns no output: it counts as the outcome ``()``,
    outside every valid output. ``alone`` decodes with the target alone (a record saying
    the draft does not pay): at N = 1 that is autoregressive decoding under the mask.
    ``constraint``: the language (default: balanced brackets); ``cfg``: ``SMCConfig`` fields.
    """
    config = SMCConfig(
        **{
            "n_particles": n,
            "block_size": 2,
            "draft_temperature": 1.0,
            "target_temperature": 1.0,
            "max_new_tokens": HORIZON,
            "seed": seed,
            # Alone means the target alone: no retrieval either, only a draft the record turns off.
            **({"proposal": "draft"} if alone else {}),
            **cfg,
        }
    )
    constraint = BalancedBrackets() if constraint is None else constraint
    record = DraftRecord(0, 50) if alone else None  # decoding alone needs a cut (the schedule) too
    counts: Counter = Counter()
    per_call = max(1, 4096 // n)  # requests per call: the rows of one call stay few thousand
    for start in range(0, runs, per_call):
        programs = [SMCSDModel(list(PROMPT), constraint, mode) for _ in range(min(per_call, runs - start))]
        engine = Engine.over(RowStore(target, draft), [EOS])
        call = SMCConfig(**{**config.__dict__, "seed": seed + start})
        for ticket in engine.run(programs, call, record=record):
            out = ticket.wait()
            counts[tuple(out.token_ids) if out.finish_reason != FinishReason.ERROR else ()] += 1
    return {y: c / runs for y, c in counts.items()}


@dataclass(frozen=True)
class ExactnessRow:
    """One sampler at one N: TV of its returned outputs from p x phi and from the local projection."""

    method: str
    n: int
    tv_global: float
    tv_local: float
    empty: float  # share of requests whose particles all died: they return nothing
    runs: int


DEPTH = "depth-"
"""A twist ``depth-k``: Phi estimated k tokens ahead by the dynamic programme (mock targets only)."""


def depth_of(twist: str | None) -> int | None:
    """The k of a twist named ``depth-k`` (None for any other twist); a bad k is an error."""
    if twist is None or not twist.startswith(DEPTH):
        return None
    k = twist.removeprefix(DEPTH)
    if not k.isdigit() or int(k) < 1:
        raise ValueError(f"a depth twist is depth-k with k >= 1 tokens, got {twist!r}")
    return int(k)


def twisted_by(twist: str | None, target: MockLM, constraint: Constraint) -> tuple[Constraint, str | None]:
    """What the programs get for ``twist``: (their constraint, the run's ``SMCConfig.twist``).

    ``depth-k`` is the k-step estimate of Phi, the chance that the next k tokens stay allowed
    (``FutureValidity(depth=k)``): it reads the target's law at every context k tokens on,
    which a mock's table gives for free and a real model would pay a forward per context for.
    It enters as a weighted constraint, like any potential; its factors telescope, so the
    weights stay proper whatever k.
    """
    k = depth_of(twist)
    if k is None:
        return constraint, twist
    return FutureValidity(constraint, lm_step(target, PROMPT), HORIZON, depth=k), None


def _label(mode: str, cut: float | None, twist: str | None = None) -> str:
    label = f"smcsd_{mode}, cut {'off' if cut is None else cut}"
    return label if twist is None else f"{label}, twist {twist}"


def grammar_exactness(
    ns: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    modes: Sequence[str] = ("proposal", "critic"),
    cuts: Sequence[float | None] = (None,),
    *,
    runs: int = 2000,
    seed: int = 0,
    twists: Sequence[str | None] = (None,),
    grammar: str = "dyck",
) -> tuple[list[ExactnessRow], dict[str, float]]:
    """SMC-SD's TV to the exact p x phi (and to the local projection) per mode, cut, twist and N.

    ``grammar`` names the case (``GRAMMARS``); ``seed`` seeds its mock pair and the runs;
    ``twists``: ``SMCConfig.twist`` values or ``depth-k`` (``twisted_by``). Returns the rows
    and the reference figures: ``local_tv`` (the local projection against p x phi, exact: what
    AR and speculative decoding under the mask sample), ``ar_masked_tv`` (the engine's own AR
    under the mask, sampled, against p x phi), ``ar_vs_local_tv`` (the same sample against the
    local projection: sampling noise only), ``z`` (P_p(valid)) and ``noise`` (the mean TV of
    ``runs`` draws from p x phi itself: the floor of every sampled row).
    """
    if grammar not in GRAMMARS:
        raise ValueError(f"unknown grammar {grammar!r}; choose from {', '.join(GRAMMARS)}")
    language, pair = GRAMMARS[grammar]
    target, draft = pair(seed)
    constraint = language()
    exact, local, z = exact_distributions(target, constraint)
    common = dict(mode="proposal", runs=runs, seed=seed, constraint=constraint)
    ar = returned_outputs(target, draft, n=1, alone=True, cut=0.3, **common)
    refs = {
        "local_tv": total_variation(exact, local),
        "ar_masked_tv": total_variation(exact, ar),
        "ar_vs_local_tv": total_variation(local, ar),
        "z": z,
        "noise": sampling_noise(exact, runs, seed),
    }
    rows = []
    for twist in twists:
        twisted_language, setting = twisted_by(twist, target, constraint)
        for cut in cuts:
            for mode in modes:
                for n in ns:
                    got = returned_outputs(
                        target,
                        draft,
                        **(common | dict(mode=mode, seed=seed + 7919 * n, constraint=twisted_language)),
                        n=n,
                        cut=cut,
                        twist=setting,
                    )
                    tvs = total_variation(exact, got), total_variation(local, got)
                    rows.append(ExactnessRow(_label(mode, cut, twist), n, *tvs, got.get((), 0.0), runs))
    return rows, refs


def plot_exactness(rows: Sequence[ExactnessRow], refs: dict[str, float], path):
    """TV from p x phi against N, one line per sampler, the local projection and the noise floor.

    Returns the figure (written to ``path``).
    """
    from ..plots import matplotlib_or_say

    matplotlib = matplotlib_or_say()
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    from matplotlib.ticker import NullLocator

    from ..plots import STYLE, finish_plot

    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(7.5, 4.6), layout="constrained")
        ax = fig.add_subplot()
        for method in dict.fromkeys(r.method for r in rows):
            mine = [r for r in rows if r.method == method]
            ax.plot([r.n for r in mine], [r.tv_global for r in mine], marker="o", label=method)
        ax.axhline(refs["local_tv"], color="black", ls="--", label="AR / SD under the mask (exact)")
        ax.axhline(refs["noise"], color="grey", ls=":", label=f"sampling noise ({rows[0].runs} runs)")
        ax.set_xscale("log", base=2)
        # One labelled tick per power of two: the log locator's own can repeat a label between ticks.
        lo, hi = min(r.n for r in rows), max(r.n for r in rows)
        powers = [2**i for i in range((lo - 1).bit_length(), hi.bit_length())] or sorted({r.n for r in rows})
        ax.set_xticks(powers, [str(n) for n in powers])
        ax.xaxis.set_minor_locator(NullLocator())
        finish_plot(
            fig,
            ax,
            path,
            xlabel="particles N",
            ylabel="TV from target x constraint",
            ylim=(0, 1.02),
            legend="lower left",
        )
    return fig
