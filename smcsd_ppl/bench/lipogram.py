"""The no-"e" program three ways: a condition inside ``extend()``, a regex, a condition after the block.

A lipogram (text without the letter "e") is LLaMPPL's running example of a condition. The same
program is written as a LLaMPPL user first writes it (``self.condition`` after each block, which
throws away every block holding an "e"), with the condition inside ``extend()`` (a per-token
test, applied once per vocabulary, that weighs the block instead), and as a ``RegexConstraint``.
All three target the same law; they run interleaved with the same seeds and N.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

from ..api import SMCSD
from ..config import SMCConfig
from ..inference.program import SMCSDModel
from .programs import ProgramRow, row_of, run_ways

NO_E = r"[^eE]*"
FORMS = ("condition", "regex", "after")
PROMPTS = (
    "Describe a cat in one sentence.",
    "Write two sentences about a walk in the park.",
    "Tell a very short story about a dog and a ball.",
    "What do you like about autumn? Answer briefly.",
)


def no_e(piece: str) -> bool:
    """The condition: no letter "e", either case."""
    return "e" not in piece.lower()


class Lipogram(SMCSDModel):
    """The condition inside ``extend()``: blocks drawn among passing tokens, weighed by their mass."""

    async def step(self) -> None:
        """One block of passing tokens."""
        await self.extend(condition=no_e)


class CheckedAfter(SMCSDModel):
    """LLaMPPL's way: extend, then condition on the text (a block with an "e" kills its particle)."""

    async def step(self) -> None:
        """One block, then the condition on the whole text."""
        await self.extend()
        self.condition(no_e(self.text))


def compare_lipogram(
    pair: SMCSD,
    config: SMCConfig,
    *,
    prompts: Sequence[str] = PROMPTS,
    forms: Sequence[str] = FORMS,
    repeats: int = 1,
    on_run: Callable[[str], None] | None = None,
) -> list[ProgramRow]:
    """Each form over every prompt, ``repeats`` times, interleaved; one row per form (medians)."""
    from ..potentials import RegexConstraint

    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        raise ValueError(f"unknown form(s) {', '.join(unknown)}; choose from {', '.join(FORMS)}")
    regex = RegexConstraint(NO_E, pair.tokenizer, pair.eos_token_ids)
    makers = {"condition": Lipogram, "regex": partial(SMCSDModel, constraint=regex), "after": CheckedAfter}
    warm = dataclasses.replace(config, max_new_tokens=4)  # the condition's mask, the regex's first states
    run_ways(pair, {f: (partial(makers[f], prompts[0]), False) for f in forms}, warm, 1)
    records: dict[str, list] = {f: [] for f in forms}
    for prompt in prompts:
        ways = {f: (partial(makers[f], prompt), False) for f in forms}
        for form, recs in run_ways(pair, ways, config, repeats, on_run).items():
            records[form] += recs
    return [row_of(form, recs) for form, recs in records.items()]
