"""The finite structure ahead of a block's end: its target mass, read in one tree forward.

Under ``twist="structure"`` (and ``"future-validity"`` where Phi cannot be computed exactly)
the one-step lookahead reads on where the constraint leaves few choices. From a block's end
x b, every allowed continuation is followed while the node's mask allows at most ``WIDTH``
tokens besides EOS (an enum's values, a required key's text, the punctuation between fields,
a bounded string's closing quote, a bracket that must close), up to ``NODES`` tokens per row;
the target reads all of them in one tree forward (``backends.tree``). Then, with p the
target's law (``p^alpha`` when ``alpha != 1``),

    Phi-hat(z) = sum over EOS e allowed at z of p(e | z) + sum over t allowed at z of p(t | z) Phi-hat(z t)
                                                                    (z followed on: its tokens are nodes)
    Phi-hat(z) = sum over t allowed at z of p(t | z)                 (a leaf: the one-step estimate)

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


@dataclass
class Tree:
    """The continuations followed from one block's end. Node 0 is the end itself (x b).

    ``tokens[j]`` and ``parents[j]`` place node j >= 1; ``masks[j]`` is what may follow node
    j, and ``followed[j]`` whether its allowed tokens (EOS aside) are all nodes.
    """

    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    masks: list[torch.Tensor | None] = field(default_factory=lambda: [None])
    followed: list[bool] = field(default_factory=lambda: [False])

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
        for (i, j), mask in zip(frontier, constrained.masks_for(pairs)):
            tree = trees[i]
            tree.masks[j] = mask
            eos = ends[i].constraint.eos_token_ids
            allowed = [t for t in mask.nonzero().flatten().tolist() if t not in eos]
            if not 0 < len(allowed) <= width or len(tree.tokens) - 1 + len(allowed) > nodes:
                continue  # a leaf: wide (free text), dead, or past the budget
            tree.followed[j] = True
            for t in allowed:
                tree.tokens.append(t)
                tree.parents.append(j)
                tree.masks.append(None)
                tree.followed.append(False)
                later.append((i, len(tree.tokens) - 1))
        frontier = later
    return trees


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
    return value[0], tuple((tree.tokens[c], value[c]) for c in children.get(0, []))
