"""A LLaMPPL program, as LLaMPPL users write it: no word longer than five letters.

Before every token the program observes that it will keep every word short (a mask
observation, LLaMPPL's hard-constraint idiom), then samples it from the model. Only the
import line ties it to SMC-SD's engine; with ``from llamppl import ...`` it is a plain
LLaMPPL program.
"""

import asyncio

from smcsd_ppl.llamppl import CachedCausalLM, LMContext, Model, smc_standard

LONGEST = 5  # letters per word


def word_masks(lm, longest=LONGEST):
    """For each length of the word in progress, the tokens that keep every word within ``longest``."""
    eos = lm.tokenizer.eos_token_id

    def fits(piece: str, done: int) -> bool:
        if not piece.strip() or "\n" in piece or len(piece.strip()) > longest:
            return False
        continues = piece[0].isalpha()  # no leading space or punctuation: the word goes on
        return not continues or done + len(piece) <= longest

    return {
        done: {i for i, piece in enumerate(lm.str_vocab) if i == eos or fits(piece, done)}
        for done in range(longest + 1)
    }


class ShortWords(Model):
    def __init__(self, lm, prompt, max_tokens=24, temp=1.0):
        super().__init__()
        self.context = LMContext(lm, prompt, temp)
        self.masks = word_masks(lm)
        self.eos = lm.tokenizer.eos_token_id
        self.left = max_tokens

    def immutable_properties(self):
        return {"masks"}

    def allowed(self):
        text = str(self.context)
        current = "" if not text or not text[-1].isalpha() else text.split()[-1]
        return self.masks[min(len(current), LONGEST)]

    async def start(self):
        await self.observe(self.context.mask_dist(self.allowed()), True)

    async def step(self):
        token = await self.sample(self.context.next_token())
        self.left -= 1
        if token == self.eos or self.left == 0:
            self.finish()
            return
        await self.observe(self.context.mask_dist(self.allowed()), True)


def main(lm=None, n_particles=8, max_tokens=24):
    lm = lm or CachedCausalLM.from_pretrained(None)  # the embedded default target
    prompt = "Here is a calm story for small children, in very short words:\n"
    particles = asyncio.run(smc_standard(ShortWords(lm, prompt, max_tokens, temp=0.7), n_particles))
    best = max(particles, key=lambda p: p.weight)
    print(str(best.context))
    return particles


if __name__ == "__main__":
    main()
