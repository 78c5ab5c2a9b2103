"""A lipogram: text without the letter "e", as a condition inside every block.

``extend(condition=test)`` asks that every token's text pass ``test``; the draft proposes
only passing tokens and the weights keep the particles on the target conditioned on it.
``smcsd compare-lipogram`` runs it beside the same program as a regex and as a condition
checked after each block.
"""

from smcsd_ppl import SMCSD, SMCConfig, SMCSDModel


def no_e(piece: str) -> bool:
    return "e" not in piece.lower()


class Lipogram(SMCSDModel):
    async def step(self):
        await self.extend(condition=no_e)


def main(pair=None, config=None):
    pair = pair or SMCSD.load()
    config = config or SMCConfig(
        n_particles=8, block_size=8, draft_temperature=0.7, target_temperature=0.7, max_new_tokens=40
    )
    [out] = pair.run([Lipogram("Describe a cat in two sentences.")], config)
    print(out.text)
    letters = out.text.lower().count("e")
    print(f'letters "e": {letters}; mean ESS {out.smc.mean_ess:.2f} of {config.n_particles}')
    return out


if __name__ == "__main__":
    main()
