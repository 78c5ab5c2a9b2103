"""A regex format: the answer must be an ISO date (YYYY-MM-DD), nothing else."""

from smcsd_ppl import SMCSD, SMCConfig, SMCSDModel
from smcsd_ppl.potentials import RegexConstraint

DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


class DateAnswer(SMCSDModel):
    """Each block is drafted under the date pattern; EOS only after a full date."""

    async def step(self):
        await self.extend()


def main(pair=None, config=None):
    pair = pair or SMCSD.load()
    # The library's temperature (0.2): at 0.7 the 135M target often rewrites the day it was given.
    config = config or SMCConfig(n_particles=8, block_size=8, max_new_tokens=24)
    date = RegexConstraint(DATE, pair.tokenizer, pair.eos_token_ids)
    # The fact is in the prompt: the constraint fixes the format, not what a 135M model recalls.
    question = "Apollo 11 landed on the Moon on July 20, 1969. Write that date as YYYY-MM-DD."
    [out] = pair.run([DateAnswer(question, date)], config)
    print(out.text if not out.message else f"{out.text} ({out.message})")
    print(
        f"{out.stats.tokens_per_second:.1f} tok/s, mean ESS {out.smc.mean_ess:.2f}, log Z {out.smc.log_z:.2f}"
    )
    return out


if __name__ == "__main__":
    main()
