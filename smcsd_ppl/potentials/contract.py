"""The ``Constraint`` contract as a reusable check, shipped with the library.

A constraint's masks must say exactly what its language says: token t may follow a
context c where c + [t] can still become an output, and an EOS token only where c
already is one; ``allows`` must agree with the masks, and a batch of contexts must get
the masks each would get alone. ``ConstraintContract`` compares a constraint with a
brute-force oracle of its language at every token of the vocabulary, at contexts
reached by random walks through the tokens it allows (and one step off them). For a
regex, the oracle is a plain regex match of the tokens' bytes::

    make = lambda: RegexConstraint(pattern, tokenizer, eos)
    ConstraintContract(make, len(tokenizer), eos, viable=is_prefix, complete=matches).check_all()

A broken constraint raises ``ContractError`` naming the check and the context.
Contexts never hold an EOS: an output ends there, and the engine asks nothing after it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from ..backends.contract import ContractError
from .constraints import Constraint

Oracle = Callable[[Sequence[int]], bool]


class ConstraintContract:
    """Checks a ``Constraint`` against an oracle of its language.

    Args:
        factory: makes a fresh constraint (fresh caches, so batch and single are compared cold).
        vocab_size: V, the width of the masks.
        eos_token_ids: the tokens that end an output.
        viable: whether the constraint should let a token sequence (without EOS) through:
            for a regex, whether its bytes are a prefix of some match.
        complete: whether a token sequence (without EOS) is an output: may end with EOS.
        seed: seeds the walks.
        walks: random walks through allowed tokens from the empty context.
        depth: tokens per walk.
    """

    CHECKS = (
        "mask_matches_language",
        "eos_only_when_complete",
        "mask_agrees_with_allows",
        "batch_equals_single",
    )

    def __init__(
        self,
        factory: Callable[[], Constraint],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        viable: Oracle,
        complete: Oracle,
        seed: int = 0,
        walks: int = 6,
        depth: int = 6,
    ) -> None:
        self.factory, self.vocab_size = factory, vocab_size
        self.eos = sorted(set(int(e) for e in eos_token_ids))
        self.viable, self.complete = viable, complete
        self.contexts = self._walk(random.Random(seed), walks, depth)

    def check_all(self) -> None:
        """Run every check; the first broken one raises ``ContractError``."""
        for name in self.CHECKS:
            getattr(self, f"check_{name}")()

    def expected_mask(self, context: Sequence[int]) -> torch.Tensor:
        """The oracle's mask ``[V]`` after ``context``: brute force over the vocabulary."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        if not self.viable(context):
            return mask  # nothing may follow a sequence the constraint would not let through
        for t in range(self.vocab_size):
            if t not in self.eos:
                mask[t] = self.viable([*context, t])
        mask[self.eos] = self.complete(context)
        return mask

    def check_mask_matches_language(self) -> None:
        """``next_mask`` allows exactly the tokens the oracle allows, at every context."""
        constraint = self.factory()
        for c in self.contexts:
            got, want = constraint.next_mask([c])[0].bool(), self.expected_mask(c)
            if not torch.equal(got.cpu(), want):
                wrong = (got.cpu() != want).nonzero().flatten().tolist()
                raise ContractError(
                    f"mask_matches_language: after {list(c)}, tokens {wrong[:8]} are "
                    f"{'allowed' if bool(got[wrong[0]]) else 'refused'} against the language"
                )

    def check_eos_only_when_complete(self) -> None:
        """An EOS token is allowed only after a complete output."""
        constraint = self.factory()
        for c in self.contexts:
            eos_allowed = bool(constraint.next_mask([c])[0][self.eos].any())
            if eos_allowed and not self.complete(c):
                raise ContractError(f"eos_only_when_complete: EOS allowed after the incomplete {list(c)}")

    def check_mask_agrees_with_allows(self) -> None:
        """``allows(c + [t])`` is ``next_mask([c])[t]`` for every context c and token t."""
        constraint = self.factory()
        for c in self.contexts:
            mask = constraint.next_mask([c])[0].bool().tolist()
            verdicts = constraint.allows([[*c, t] for t in range(self.vocab_size)])
            for t, (m, a) in enumerate(zip(mask, verdicts)):
                if bool(a) != m:
                    raise ContractError(
                        f"mask_agrees_with_allows: after {list(c)}, token {t}: mask {m}, allows {bool(a)}"
                    )

    def check_batch_equals_single(self) -> None:
        """A batch of contexts gets the masks (and ``allows`` verdicts) each gets alone."""
        batched, single = self.factory(), self.factory()
        masks = batched.next_mask(self.contexts).bool().cpu()
        for i, c in enumerate(self.contexts):
            if not torch.equal(masks[i], single.next_mask([c])[0].bool().cpu()):
                raise ContractError(f"batch_equals_single: the mask after {list(c)} depends on its batch")
        sequences = [
            [*c, t]
            for c, mask in zip(self.contexts, masks)
            for t in (*self.eos, *_allowed(mask)[:2], *_allowed(~mask)[:1])
        ]
        together = self.factory().allows(sequences)
        alone = [single.allows([s])[0] for s in sequences]
        for s, a, b in zip(sequences, together, alone):
            if bool(a) != bool(b):
                raise ContractError(f"batch_equals_single: allows({s}) depends on its batch")

    def _walk(self, rng: random.Random, walks: int, depth: int) -> list[list[int]]:
        """Prefixes of random walks through allowed non-EOS tokens, and one refused step off each."""
        constraint = self.factory()
        contexts = {(): None}
        for _ in range(walks):
            context: list[int] = []
            for _ in range(depth):
                mask = constraint.next_mask([context])[0].bool().cpu()
                mask[self.eos] = False
                allowed = _allowed(mask)
                refused = [t for t in _allowed(~mask) if t not in self.eos]
                if refused:
                    contexts[(*context, rng.choice(refused))] = None  # a dead context: nothing follows
                if not allowed:
                    break
                context.append(rng.choice(allowed))
                contexts[tuple(context)] = None
        return [list(c) for c in contexts]


def _allowed(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()
