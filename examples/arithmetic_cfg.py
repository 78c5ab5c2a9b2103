"""A context-free grammar: the answer is an arithmetic expression (genlm-control's BoolCFG).

The grammar restricts the proposal: the draft samples only tokens the grammar allows.
Any genlm-control potential works this way; a grammar's masks come from genlm-control's
parser and cost far more than a regex's (see docs/constraints.md). With ``MODE =
"critic"`` particles draft freely and die on the first token outside the grammar,
which a weak draft rarely avoids.
"""

from genlm.control import BoolCFG

from smcsd_ppl import SMCSD, SMCConfig, SMCSDModel
from smcsd_ppl.potentials import PotentialConstraint

GRAMMAR = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""


MODE = "proposal"


class Expression(SMCSDModel):
    async def step(self):
        await self.extend()


def main(pair=None, config=None):
    pair = pair or SMCSD.load()
    config = config or SMCConfig(
        n_particles=8, block_size=8, draft_temperature=0.7, target_temperature=0.7, max_new_tokens=24
    )
    grammar = PotentialConstraint(BoolCFG.from_lark(GRAMMAR), pair.tokenizer, pair.eos_token_ids)
    prompt = "Write an arithmetic expression whose value is 12, using only digits and + - * /."
    [out] = pair.run([Expression(prompt, grammar, mode=MODE)], config)
    print(out.text if out.text else out.message)
    print(
        f"{out.stats.tokens_per_second:.1f} tok/s, mean ESS {out.smc.mean_ess:.2f}, log Z {out.smc.log_z:.2f}"
    )
    return out


if __name__ == "__main__":
    main()
