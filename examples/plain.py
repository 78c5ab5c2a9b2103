"""Plain SMC-SD generation, written as a program: the built-in default, spelled out."""

from smcsd_ppl import SMCSD, SMCConfig, SMCSDModel


class Plain(SMCSDModel):
    """Every step drafts K tokens per particle, scores them in one target call, adds the bonus."""

    async def step(self):
        await self.extend()


def main(pair=None, config=None):
    pair = pair or SMCSD.load()
    config = config or SMCConfig(
        n_particles=8, block_size=8, draft_temperature=0.7, target_temperature=0.7, max_new_tokens=64
    )
    [out] = pair.run([Plain("Give me one tip for learning to cook.")], config)
    print(out.text)
    s = out.stats
    print(
        f"{s.tokens_per_second:.1f} tok/s, {s.tokens_per_target_call:.1f} tokens/target call, "
        f"{out.smc.n_resamples} resamples, mean ESS {out.smc.mean_ess:.2f}, log Z {out.smc.log_z:.2f}"
    )
    return out


if __name__ == "__main__":
    main()
