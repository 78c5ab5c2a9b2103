"""Grammar-conditional exactness on a real model, where the language is finite.

A language here is a few strings answering a prompt. Its exact conditional law p(x | valid)
comes from scoring every token path the constraint allows (every tokenization of every
string, as llguidance allows them all) under the target, one batched forward per depth.
Locally masked decoding's law (what AR, SD, vLLM or llama.cpp sample under a mask) comes from
a second walk that normalises over the allowed tokens at each step. Paths under a floor are
dropped and their mass reported. SMC-SD's returned texts over many seeded requests are then
compared with the exact law: no mock is involved.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..config import SMCConfig
from ..ends import FinishReason
from ..inference.program import SMCSDModel
from ..potentials.grammar import RegexConstraint
from .grammar_exact import total_variation

FLOOR = 1e-6  # a path is dropped once its probability falls under this share of the reference
MAX_NODES = 200_000  # token paths one walk may open before it refuses the language


@dataclass(frozen=True)
class Language:
    """A finite language: the strings a constrained answer to ``prompt`` may be."""

    name: str
    prompt: str
    choices: tuple[str, ...]

    @property
    def pattern(self) -> str:
        """The regex the constraint compiles: exactly one of the choices."""
        return "(" + "|".join(re.escape(c) for c in self.choices) + ")"


# Each: one answer the model expects, forced on into unlikely words, against plausible answers.
# Masked decoding takes the expected first token and is then carried through the dead end;
# the conditional law puts almost nothing there.
LANGUAGES = {
    lang.name: lang
    for lang in (
        Language("capital", "What is the capital of France?", ("Paris of frogs", "Lyon", "Marseille")),
        Language("color", "Name a primary color.", ("Red cow says moo", "Blue", "Yellow")),
        Language("planet", "Which planet is closest to the sun?", ("Mercury is a cat", "Venus", "Mars")),
    )
}


@dataclass
class Walk:
    """The strings a walk reached, each with the summed probability of its token paths."""

    texts: dict[str, float]
    pruned: float  # mass of the prefixes dropped under the floor: a bound on what they lose
    paths: int  # complete token paths (tokenizations) summed into ``texts``


def constraint_of(pair, language: Language) -> RegexConstraint:
    """The language as the engine's regex constraint on the pair's tokenizer."""
    return RegexConstraint(
        language.pattern, pair.tokenizer, pair.eos_token_ids, vocab_size=pair.core.target_lm.vocab_size
    )


def walk(
    lm, prompt: Sequence[int], constraint, *, local: bool, floor: float, temperature: float = 1.0
) -> dict:
    """Every token path ``constraint`` allows after ``prompt``, up to an EOS, with its log-probability.

    Under the target at ``temperature`` (``local``: renormalised over the allowed tokens at each
    step, as masked decoding samples). Runs on the torch thread; one ``lm`` forward per depth,
    every open path a row. Returns ``{"done": [(path, log p)], "pruned": p}``: paths whose
    log-probability falls under ``log(floor)`` are dropped; ``pruned``, the mass of the dropped
    prefixes, bounds what they would have added.
    """
    eos = set(constraint.eos_token_ids)
    logits, front = lm.prefill([list(prompt)]), [((), 0.0)]
    done, pruned, opened = [], 0.0, 0
    while front:
        masks = constraint.next_mask([list(p) for p, _ in front])
        logp = torch.log_softmax(logits.double() / temperature, -1)
        kids, parents = [], []
        for i, (path, lp) in enumerate(front):
            allowed = masks[i].nonzero().flatten()
            steps = logp[i, allowed]
            if local:
                steps = steps - torch.logsumexp(steps, 0)
            for t, s in zip(allowed.tolist(), steps.tolist()):
                if t in eos:
                    done.append((path, lp + s))
                elif lp + s < math.log(floor):
                    pruned += math.exp(lp + s)
                else:
                    kids.append((path + (t,), lp + s))
                    parents.append(i)
        opened += len(kids)
        if opened > MAX_NODES:
            raise ValueError(f"the language opens over {MAX_NODES} token paths: use shorter strings")
        if kids:
            lm.fork(torch.tensor(parents))
            logits = lm.extend(torch.tensor([[p[-1]] for p, _ in kids]))[:, -1]
        front = kids
    return {"done": done, "pruned": pruned}


def canonical_log_p(
    lm, prompt: Sequence[int], seqs: Sequence[Sequence[int]], temperature: float = 1.0
) -> list:
    """The log-probability of each token sequence after ``prompt`` (its EOS included), one forward for all."""
    first = torch.log_softmax(lm.prefill([list(prompt)]).double() / temperature, -1)[0]
    width = max(len(s) for s in seqs)
    lm.fork(torch.zeros(len(seqs), dtype=torch.long))
    ids = torch.tensor([list(s) + [0] * (width - len(s)) for s in seqs])
    valid = torch.arange(width)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]
    logp = torch.log_softmax(lm.extend(ids, valid).double() / temperature, -1)
    out = []
    for r, s in enumerate(seqs):
        out.append(float(first[s[0]]) + sum(float(logp[r, j, s[j + 1]]) for j in range(len(s) - 1)))
    return out


def texts_of(found: dict, decode: Callable[[list[int]], str]) -> Walk:
    """A walk's paths summed per string."""
    texts: dict[str, float] = {}
    for path, lp in found["done"]:
        text = decode(list(path))
        texts[text] = texts.get(text, 0.0) + math.exp(lp)
    return Walk(texts, found["pruned"], len(found["done"]))


@dataclass(frozen=True)
class Reference:
    """A language's exact laws on the target."""

    conditional: dict[str, float]  # p(x | valid), over strings
    masked: dict[str, float]  # locally masked decoding's law
    z: float  # P_p(valid): the mass of the language (the walk's paths)
    pruned: float  # mass dropped from the conditional walk (a bound), as a share of z
    masked_pruned: float  # mass masked decoding puts on prefixes dropped from its walk
    paths: int  # tokenizations in the conditional walk


def reference(pair, language: Language, *, temperature: float = 1.0, floor: float = FLOOR) -> Reference:
    """Both exact laws of ``language`` under ``pair``'s target (its forwards on the pair's torch thread)."""
    lm, constraint = pair.core.target_lm, constraint_of(pair, language)
    prompt, eos = pair.encode(language.prompt), pair.eos_token_ids[0]
    seqs = [pair.tokenizer.encode(c, add_special_tokens=False) + [eos] for c in language.choices]

    def run():
        # The floor is a share of the likeliest choice's canonical path: a bound under z.
        ref = max(canonical_log_p(lm, prompt, seqs, temperature))
        joint = walk(
            lm, prompt, constraint, local=False, floor=floor * math.exp(ref), temperature=temperature
        )
        masked = walk(lm, prompt, constraint, local=True, floor=floor, temperature=temperature)
        return joint, masked

    joint, masked = pair.call(run)
    decode = pair.tokenizer.decode
    joint, masked = texts_of(joint, decode), texts_of(masked, decode)
    z = sum(joint.texts.values())
    conditional = {t: p / z for t, p in joint.texts.items()}
    return Reference(conditional, masked.texts, z, joint.pruned / z, masked.pruned, joint.paths)


def returned_texts(pair, language: Language, config: SMCConfig, runs: int, *, per_call: int = 256) -> dict:
    """The law of SMC-SD's returned texts over ``runs`` requests, seeded from ``config.seed``.

    A request that returns nothing (every particle died) counts as ``None``, outside the language.
    ``per_call``: particles submitted per call (the engine runs as many at once as its ``max_rows``).
    """
    constraint, prompt = constraint_of(pair, language), pair.encode(language.prompt)
    counts: Counter = Counter()
    step = max(1, per_call // config.n_particles)
    for start in range(0, runs, step):
        call = dataclasses.replace(config, seed=config.seed + start)
        programs = [SMCSDModel(list(prompt), constraint, "proposal") for _ in range(min(step, runs - start))]
        for ticket in pair.engine.run(programs, call):
            out = ticket.wait()
            counts[None if out.finish_reason == FinishReason.ERROR else _answer(pair, out.token_ids)] += 1
    return {t: c / runs for t, c in counts.items()}


def _answer(pair, ids: Sequence[int]) -> str:
    """The text of a returned output, its EOS dropped."""
    eos = set(pair.eos_token_ids)
    return pair.tokenizer.decode([t for t in ids if t not in eos])


@dataclass(frozen=True)
class RealRow:
    """One sampler at one N on one language: TV of its returned texts from the exact conditional."""

    language: str
    method: str
    n: int
    tv: float
    empty: float  # share of requests that returned nothing
    runs: int


def real_exactness(
    pair,
    languages: Sequence[Language],
    ns: Sequence[int] = (1, 8, 16),
    twists: Sequence[str | None] = (None, "lookahead", "structure"),
    *,
    runs: int = 1000,
    seed: int = 0,
    on_row: Callable[[RealRow], None] | None = None,
) -> tuple[list[RealRow], dict[str, Reference]]:
    """SMC-SD's TV from the exact conditional per language, twist and N, at T = 1 and the default cut.

    Returns the rows and each language's ``Reference`` (masked decoding's TV is exact: its law
    is computed, not sampled).
    """
    rows, refs = [], {}
    for language in languages:
        refs[language.name] = ref = reference(pair, language)
        longest = max(len(pair.tokenizer.encode(c, add_special_tokens=False)) for c in language.choices)
        base = SMCConfig(draft_temperature=1.0, target_temperature=1.0, max_new_tokens=longest + 8, seed=seed)
        for twist in twists:
            for n in ns:
                config = dataclasses.replace(base, n_particles=n, twist=twist, seed=seed + 7919 * n)
                got = returned_texts(pair, language, config, runs)
                row = RealRow(
                    language.name,
                    _method(twist),
                    n,
                    total_variation(ref.conditional, got),
                    got.get(None, 0.0),
                    runs,
                )
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows, refs


def _method(twist: str | None) -> str:
    return "smcsd, no twist" if twist is None else f"smcsd, twist {twist}"
