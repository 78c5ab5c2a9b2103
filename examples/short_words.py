"""A lexical hard constraint: every word has at most five letters."""

from smcsd_ppl import SMCSD, SMCConfig, SMCSDModel
from smcsd_ppl.potentials import RegexConstraint

SHORT_WORDS = r"[^A-Za-z]*([A-Za-z]{1,5}[^A-Za-z]+)*[A-Za-z]{0,5}"


class ShortWords(SMCSDModel):
    async def step(self):
        await self.extend()


def main(pair=None, config=None):
    pair = pair or SMCSD.load()
    config = config or SMCConfig(
        n_particles=8, block_size=8, draft_temperature=0.7, target_temperature=0.7, max_new_tokens=48
    )
    short = RegexConstraint(SHORT_WORDS, pair.tokenizer, pair.eos_token_ids)
    [out] = pair.run([ShortWords("Tell me about the sea in simple words.", short)], config)
    print(out.text)
    longest = max((len(w) for w in "".join(c if c.isalpha() else " " for c in out.text).split()), default=0)
    print(
        f"longest word: {longest} letters; {out.stats.tokens_per_second:.1f} tok/s, "
        f"mean ESS {out.smc.mean_ess:.2f}"
    )
    return out


if __name__ == "__main__":
    main()
