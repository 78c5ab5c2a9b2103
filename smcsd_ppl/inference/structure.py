"""The finite structure ahead of a block's end: its target mass, read in one tree forward.

Under ``twist="structure"`` (and ``"future-validity"`` where Phi cannot be computed exactly)
the one-step lookahead reads on where the constraint leaves few choices. From a block's end
x b, every allowed continuation is followed while the node's mask allows at most ``WIDTH``
tokens besides EOS (an enum's values, a required key's text, the punctuation between fields,
a bounded string's closing quote, a bracket that must close), up to ``NODES`` tokens per row;
the target reads all of them in one tree forward (``backends.tree``). Where the grammar fixes
the next characters (an enum value once its first word is out, a key, a literal phrase), every
split of that text is allowed: the tree follows its canonical tokenization alone, one token per
node, so a forced dead end is read however many splits the mask allows. Then, with p the
target's law (``p^alpha`` when ``alpha != 1``),

    Phi-hat(z) = sum over EOS e allowed at z of p(e | z) + sum over t allowed at z of p(t | z) Phi-hat(z t)
                                                                    (z followed on: its tokens are nodes)
    Phi-hat(z) = sum over t allowed at z of p(t | z)                 (a leaf: the one-step estimate)
    Phi-hat(z) = p(c | z) Phi-hat(z c)              (forced text: c its canonical next token)

This is the future validity exactly through the structure read, and the one-step estimate at
its edge, where the grammar opens up again (free text) or the budget ends. With nothing to
follow (a wide mask at x b) it is the one-step lookahead. It twists the block's end, and the
next block's first token is drawn from p(t | x b) Phi-hat(x b t) / Phi-hat(x b) and weighed by
the inverse ratio (``cycle._leads``), so the tilt steers without entering the target. Any
positive value keeps the weights proper; the closer to Phi, the less they vary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import constrained

WIDTH = 4  # a mask allowing at most this many tokens (EOS aside) is a finite structure's: follow them all
NODES = 16  # tokens one row may read past its block's end (the tree forward's width)
WORDS = 64  # a wider mask is free text; a narrower one may hold the splits of a few words


@dataclass
class Tree:
    """The continuations followed from one block's end. Node 0 is the end itself (x b).

    ``tokens[j]`` and ``parents[j]`` place node j >= 1; ``masks[j]`` is what may follow node
    j, ``followed[j]`` whether its children are read: all its allowed tokens but EOS, or, where
    ``forced[j]``, the canonical first token of the forced text or of each word the allowed
    tokens begin (``aliases``, at the end: which node stands for each allowed token).
    """

    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    masks: list[torch.Tensor | None] = field(default_factory=lambda: [None])
    followed: list[bool] = field(default_factory=lambda: [False])
    forced: list[bool] = field(default_factory=lambda: [False])
    aliases: dict[int, int] = field(default_factory=dict)

    def add(self, token: int, parent: int) -> int:
        """A node for ``token`` after node ``parent``; its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.masks.append(None)
        self.followed.append(False)
        self.forced.append(False)
        return len(self.tokens) - 1

    def path(self, j: int) -> list[int]:
        """The tokens from the end to node j (node j's included)."""
        out = []
        while j > 0:
            out.append(self.tokens[j])
            j = self.parents[j]
        return out[::-1]


def grow(ends: Sequence, width: int = WIDTH, nodes: int = NODES) -> list[Tree]:
    """A tree per block end (``RowConstraint`` whose context ends at x b), one mask call per level."""
    trees = [Tree() for _ in ends]
    frontier = [(i, 0) for i in range(len(ends))]
    while frontier:
        pairs = [(ends[i].constraint, (*ends[i].context, *trees[i].path(j))) for i, j in frontier]
        later = []
        for (i, j), (constraint, context), mask in zip(frontier, pairs, constrained.masks_for(pairs)):
            tree = trees[i]
            tree.masks[j] = mask
            allowed = [t for t in mask.nonzero().flatten().tolist() if t not in constraint.eos_token_ids]
            aliases = _aliases(constraint, context, allowed, width)
            follow = list(dict.fromkeys(aliases.values()))
            if not follow or len(tree.tokens) - 1 + len(follow) > nodes:
                continue  # a leaf: free text, dead, or past the budget
            tree.followed[j], tree.forced[j] = True, len(follow) < len(allowed)
            later += [(i, tree.add(t, j)) for t in follow]
            tree.aliases = aliases if j == 0 else tree.aliases
        frontier = later
    return trees


def _aliases(constraint, context: Sequence[int], allowed: list[int], width: int) -> dict[int, int]:
    """Each allowed token's node to follow: itself, or the canonical first token of its word.

    A forced text's splits all stand for its canonical first token; a mask of a few words'
    splits, for each word's first token (a split several words share is its own node). Empty
    where nothing is followed: a wide mask (free text) or too many words.
    """
    forced = constraint.forced_tokens(context)[:1] if len(allowed) > 1 else []
    if forced:
        return dict.fromkeys(allowed, forced[0])
    if len(allowed) <= width:
        return {t: t for t in allowed}
    if len(allowed) > WORDS:
        return {}
    words = {t: constraint.word_start(context, t) for t in allowed}
    return words if len(set(words.values())) <= width else {}


Tilt = tuple[tuple[int, float], ...]  # (token, log Phi-hat after it) for each token followed


def log_phi(tree: Tree, log_law: torch.Tensor, eos: Sequence[int]) -> tuple[float, Tilt]:
    """Log Phi-hat at the tree's end, and after each token followed from it (the next lead's tilt).

    ``log_law [nodes, V]``: log p^alpha of the next token at each node.
    """
    masks = torch.stack(tree.masks)
    one_step = torch.logsumexp(log_law.masked_fill(~masks, -math.inf), -1).tolist()
    value = [0.0] * len(tree.tokens)
    children: dict[int, list[int]] = {}
    for j in range(1, len(tree.tokens)):
        children.setdefault(tree.parents[j], []).append(j)
    for j in reversed(range(len(tree.tokens))):  # children come after their parent
        if not tree.followed[j]:
            value[j] = one_step[j]
            continue
        terms = [float(log_law[j, e]) for e in eos if masks[j, e]]
        terms += [float(log_law[j, tree.tokens[c]]) + value[c] for c in children[j]]
        value[j] = torch.logsumexp(torch.tensor(terms, dtype=torch.float64), 0).item()
    # A split not read is tilted as the word it begins: "B" as "Blue", the splits of a forced text alike.
    read = {tree.tokens[c]: value[c] for c in children.get(0, [])}
    return value[0], tuple((t, read[c]) for t, c in tree.aliases.items() if c in read)
