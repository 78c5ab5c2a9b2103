"""A twisted program: a heuristic value guides resampling without changing the target.

``self.twist(v)`` multiplies the particle's weight by exp(v) for the next resampling
decision only; the loop divides it back out before the next step and at the end,
so the final target is still the model's distribution (LLaMPPL's semantics).
"""

from smcsd_ppl import SMCSD, SMCConfig, SMCSDModel

KEYWORDS = ("garden", "flower", "tree", "green")


class Gardener(SMCSDModel):
    async def step(self):
        await self.extend()
        if not self.finished:  # favour particles on topic while they are still running
            self.twist(0.5 * sum(self.text.lower().count(k) for k in KEYWORDS))


def main(pair=None, config=None):
    pair = pair or SMCSD.load()
    config = config or SMCConfig(
        n_particles=8, block_size=8, draft_temperature=0.7, target_temperature=0.7, max_new_tokens=48
    )
    [out] = pair.run([Gardener("Write two sentences about spring.")], config)
    print(out.text)
    print(
        f"{out.stats.tokens_per_second:.1f} tok/s, {out.smc.n_resamples} resamples, log Z {out.smc.log_z:.2f}"
    )
    return out


if __name__ == "__main__":
    main()
