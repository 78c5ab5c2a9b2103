"""The one-step lookahead twist reads the target's law after each block's end (fast tier).

Its twist must be log Phi-hat(y): the mass the target's next-token law after the whole prefix
y (the bonus included) puts on what the constraint allows next. The law the bonus was drawn
from (one token earlier) is not a stand-in: on JSON it scored a string's closing quote by the
string's own law and steered particles away from closing anything.
"""

from __future__ import annotations

import pytest
import torch

from smcsd_ppl.bench import grammar_exact as ge
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.engine.run import run_smc_sd
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.rows import RowStore


class Recording(SMCSDModel):
    """Records each twist with the prefix it was given at."""

    seen: list[tuple[tuple[int, ...], float]] = []

    def twist(self, amt):
        Recording.seen.append((tuple(self.main_context.generated), amt))
        super().twist(amt)


@pytest.mark.parametrize("grammar", ["dyck", "garden"])
def test_the_lookahead_twist_is_the_valid_mass_of_the_law_after_the_block(grammar):
    language, pair = ge.GRAMMARS[grammar]
    target, draft = pair(0)
    constraint = language()
    Recording.seen = []
    config = SMCConfig(
        n_particles=2, block_size=2, draft_temperature=1.0, target_temperature=0.7,
        max_new_tokens=ge.HORIZON, seed=3, twist="lookahead",
    )  # fmt: skip
    programs = [Recording(list(ge.PROMPT), constraint) for _ in range(20)]
    run_smc_sd(programs, RowStore(target, draft), config, [ge.EOS])
    assert len(Recording.seen) >= 20
    for y, amt in Recording.seen:
        law = torch.log_softmax(target.next_logits(list(ge.PROMPT) + list(y)).double() / 0.7, -1)
        allowed = constraint.next_mask([y])[0]
        assert amt == pytest.approx(float(torch.logsumexp(law[allowed], -1)), abs=1e-5), y
