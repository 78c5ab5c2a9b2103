"""A LLaMPPL program, as LLaMPPL users write it: a poem with a fixed syllable count per line.

Words are sampled whole with LLaMPPL's ``sample_word`` (mask observations and draws of the
next token), a line that overshoots its syllables is rejected with ``condition``, and each
line break (and the final end of text) is an *observed* next token: the program conditions
on the model writing it. Only the import line ties it to SMC-SD's engine.
"""

import asyncio
import re

from llamppl import sample_word

from smcsd_ppl.llamppl import CachedCausalLM, LMContext, Model, smc_standard


def syllables(word: str) -> int:
    """A rough count that needs no dictionary: vowel groups, less a silent final e (100 for non-words)."""
    w = word.strip().lower()
    if not w.isalpha():
        return 100
    groups = len(re.findall(r"[aeiouy]+", w))
    if groups > 1 and w.endswith("e") and not w.endswith(("le", "ee")):
        groups -= 1
    return max(1, groups)


class Poem(Model):
    def __init__(self, lm, prompt, pattern=(5, 7, 5), temp=1.0):
        super().__init__()
        self.context = LMContext(lm, prompt, temp, show_eos=False)
        self.pattern = list(pattern)
        self.newline = lm.str_vocab.index("\n")
        self.eos = lm.tokenizer.eos_token_id

    async def step(self):
        left = self.pattern.pop(0)
        while left > 0:
            word, _ = await self.call(sample_word(self.context))
            left -= syllables(word)
        self.condition(left == 0)  # overshot: this particle is dead
        if self.finished:
            return
        if not self.pattern:
            await self.observe(self.context.next_token(), self.eos)
            self.finish()
            return
        await self.observe(self.context.next_token(), self.newline)


def main(lm=None, n_particles=8, pattern=(3, 5, 3)):
    lm = lm or CachedCausalLM.from_pretrained(None)  # the embedded default target
    prompt = "A short poem about the sea, three lines:\n\nWaves"
    particles = asyncio.run(smc_standard(Poem(lm, prompt, pattern, temp=0.8), n_particles))
    alive = [p for p in particles if p.weight > float("-inf")]
    best = max(alive or particles, key=lambda p: p.weight)
    print("Waves" + str(best.context))
    return particles


if __name__ == "__main__":
    main()
