"""The finite structure ahead of a block's end: its target mass, read in one tree forward.

Under ``twist="structure"`` (and ``"future-validity"`` where Phi cannot be computed exactly)
the one-step lookahead reads on where the constraint leaves few choices. From a block's end
x b, every allowed continuation is followed while the node's mask allows at most ``WIDTH``
tokens besides EOS (an enum's values, a required key's text, the punctuation between fields,
a bounded string's closing quote, a bracket that must close), up to ``NODES`` tokens per row
(``FIRST_NODES`` before a context's first token); the target reads them all in one tree
forward (``backends.tree``). Where the grammar fixes the next characters (an enum value once
its first word is out, a key, a literal phrase), every split of that text is allowed: the tree
follows its canonical tokenization, one token per node, so a forced dead end is read however
many splits the mask allows; the room left then reads the other splits s as leaves, nearest
first, since a model may write the text otherwise (`` {`` then ``"``) or hardly go on from a
split (`` f`` begins many words). A mask of a few words' splits reads each split with the text
it forces where they fit, else each word from its canonical first token. Then, with p the
target's law (``p^alpha`` when ``alpha != 1``),

    Phi-hat(z) = sum over EOS e allowed at z of p(e | z) + sum over t allowed at z of p(t | z) Phi-hat(z t)
                                                                    (z followed on: its tokens are nodes)
    Phi-hat(z) = sum over t allowed at z of p(t | z)                 (a leaf: the one-step estimate)
    Phi-hat(z) = p(c | z) Phi-hat(z c) + sum over splits s read of p(s | z) Phi-1(z s) Phi-hat(z c)
                                     (forced text: c its canonical next token, Phi-1 the one-step)

This is the future validity exactly through the structure read (along a forced text, but for
the splits not read), and the one-step estimate at its edge, where the grammar opens up again
(free text) or the budget ends. With nothing to follow (a wide mask at x b) it is the one-step
lookahead. It twists the block's end, and the next block's first token is drawn from
p(t | x b) Phi-hat(x b t) / Phi-hat(x b) and weighed by the inverse ratio (``cycle._leads``).
While the block's tokens stay on the tree, each drafted token comes from q(t | z) Phi-hat(z t)
renormalised and weighs the density it was drawn from (``constrained.Masking``), and the bonus
is drawn as the lead is (``verification.verify_blocks``, ``BlockBatch.log_tilt``). So the tilt
steers the proposal without entering the target: with the whole structure read and the target
as its own draft, one particle samples the conditional law. Any positive value keeps the
weights proper; the closer to Phi, the less they vary.

Under ``twist="finite"`` a tree that opens (``Tree.opens``: a path stops at free text, not at the
output's end or the budget) is not read: that end is twisted by nothing (Phi-hat 1, a value of
the prefix alone) and its bonus waits for the next verify. So an end inside free text costs no
forward, and the read runs where the estimate is Phi itself or close to it (the rest of an enum,
an object of enums), not where its one-step edge would steer particles away from closing a field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import constrained

WIDTH = 4  # a mask allowing at most this many tokens (EOS aside) is a finite structure's: follow them all
NODES = 16  # tokens one row may read past its block's end (the tree forward's width)
FIRST_NODES = 48  # ... and before a context's first token: once per request, its rows twins
WORDS = 64  # a wider mask is free text; a narrower one may hold the splits of a few words


@dataclass
class Tree:
    """The continuations followed from one block's end. Node 0 is the end itself (x b).

    ``tokens[j]`` and ``parents[j]`` place node j >= 1; ``masks[j]`` is what may follow node
    j, ``followed[j]`` whether its children are read: all its allowed tokens but EOS, or, where
    ``forced[j]``, the canonical first token of the forced text or of each word the allowed
    tokens begin. ``aliases[j]`` says which child stands for each token allowed at node j.
    ``beside[j]``: for another split of a forced text, read as a leaf, its canonical sibling.
    ``opens``: a path stops at more choices than the read follows (free text), not only at
    the output's end or the budget.
    """

    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    masks: list[torch.Tensor | None] = field(default_factory=lambda: [None])
    followed: list[bool] = field(default_factory=lambda: [False])
    forced: list[bool] = field(default_factory=lambda: [False])
    aliases: list[dict[int, int]] = field(default_factory=lambda: [{}])
    beside: list[int] = field(default_factory=lambda: [-1])
    opens: bool = False

    def add(self, token: int, parent: int, beside: int = -1) -> int:
        """A node for ``token`` after node ``parent``; its index."""
        for column, value in (
            (self.tokens, token),
            (self.parents, parent),
            (self.masks, None),
            (self.followed, False),
            (self.forced, False),
            (self.aliases, {}),
            (self.beside, beside),
        ):
            column.append(value)
        return len(self.tokens) - 1

    def path(self, j: int) -> list[int]:
        """The tokens from the end to node j (node j's included)."""
        out = []
        while j > 0:
            out.append(self.tokens[j])
            j = self.parents[j]
        return out[::-1]


def grow(ends: Sequence, width: int = WIDTH, nodes: int = NODES) -> list[Tree]:
    """A tree per block end (``RowConstraint`` whose context ends at x b), one mask call per level.

    What the constraint allows is followed first, level by level; the room left then reads the
    other splits of each forced text, nearest first (``_read_splits``). A ``finite`` end's tree
    stops growing once it opens: it will not be read.
    """
    trees = [Tree() for _ in ends]
    frontier = [(i, 0) for i in range(len(ends))]
    while frontier:
        later = []
        for (i, j), (constraint, context), mask in _masked(ends, trees, frontier):
            tree = trees[i]
            if ends[i].finite and tree.opens:
                continue
            count = int(mask.sum()) - int(mask[list(constraint.eos_token_ids)].sum())  # EOS aside
            forced = constraint.forced_tokens(context)[:1] if count > 1 else []
            if count > WORDS and not forced:  # free text, told before the mask is listed: most ends
                tree.opens = True
                continue
            allowed = [t for t in mask.nonzero().flatten().tolist() if t not in constraint.eos_token_ids]
            aliases = _aliases(constraint, context, allowed, forced, width, nodes - len(tree.tokens) + 1)
            follow = list(dict.fromkeys(aliases.values()))
            if not follow or len(tree.tokens) - 1 + len(follow) > nodes:
                tree.opens |= not follow and bool(allowed)  # free text, not an end or the budget
                continue  # a leaf: free text, dead, or past the budget
            tree.followed[j], tree.forced[j], tree.aliases[j] = True, len(follow) < len(allowed), aliases
            later += [(i, tree.add(t, j)) for t in follow]
        frontier = later
    unread = {i for i, (e, t) in enumerate(zip(ends, trees)) if e.finite and t.opens}
    _masked(ends, trees, _read_splits(trees, nodes, unread))
    return trees


def _masked(ends: Sequence, trees: list[Tree], at: list[tuple[int, int]]) -> list[tuple]:
    """``((tree, node), (constraint, context), mask)`` for each node ``at``, its mask kept (one call)."""
    pairs = [(ends[i].constraint, (*ends[i].context, *trees[i].path(j))) for i, j in at]
    out = list(zip(at, pairs, constrained.masks_for(pairs)))
    for (i, j), _, mask in out:
        trees[i].masks[j] = mask
    return out


def _read_splits(trees: list[Tree], nodes: int, unread: set[int]) -> list[tuple[int, int]]:
    """Leaves for the other splits of each forced text, nearest first, within ``nodes``; where they sit.

    ``unread``: the trees no forward will read (none added).

    A model may write a forced text otherwise than canonically (`` {`` then ``"`` where `` {"``
    is canonical) or hardly go on from a split at all (`` f`` begins many words): a leaf reads
    which, and the split then goes on as its canonical sibling does.
    """
    added = []
    for i, tree in enumerate(trees):
        if i in unread:
            continue
        for j in range(len(tree.tokens)):  # in the order read: nearer first
            kids = [c for c in range(j + 1, len(tree.tokens)) if tree.parents[c] == j]
            if not tree.forced[j] or len(kids) != 1:  # a forced text: one canonical token read
                continue
            for t, stands_for in list(tree.aliases[j].items()):
                if t != stands_for and len(tree.tokens) - 1 < nodes:
                    added.append((i, tree.add(t, j, beside=kids[0])))
                    tree.aliases[j][t] = t
    return added


def _aliases(
    constraint, context: Sequence[int], allowed: list[int], forced: list[int], width: int, room: int
) -> dict[int, int]:
    """Each allowed token's node to follow: itself, or the canonical first token of its word.

    A forced text's splits all stand for its canonical first token (``forced``: it, where the
    constraint forces a text). A mask of a few words'
    splits reads each split on its own where every split and the text it forces fit in
    ``room`` nodes; else each word from its first token (a split several words share is its
    own node). Empty where nothing is followed: a wide mask (free text) or too many words.
    """
    if forced:
        return dict.fromkeys(allowed, forced[0])
    if len(allowed) <= width:
        return {t: t for t in allowed}
    if len(allowed) > WORDS:
        return {}
    words = {t: constraint.word_start(context, t) for t in allowed}
    if len(set(words.values())) > width:
        return {}
    # A split the model seldom goes on from ("M" of "Marseille", which it writes "Mar" first)
    # would be tilted as its word, and drawn far more often than it ends well.
    if len(allowed) > room:  # not even a node per split: no need to count what they force
        return words
    own = sum(1 + len(constraint.forced_tokens((*context, t))) for t in allowed)
    return {t: t for t in allowed} if own <= room else words


Tilt = tuple[tuple[int, float], ...]  # (token, log Phi-hat after it) for each token followed at a node
Tilts = dict[tuple[int, ...], Tilt]  # the tilt at each node followed, by its path from the tree's end


def log_phi(tree: Tree, log_law: torch.Tensor, eos: Sequence[int]) -> tuple[float, Tilts]:
    """Log Phi-hat at the tree's end, and the tilt at each node followed (the next block's proposal).

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
        for c in children[j]:
            if tree.beside[c] >= 0:  # a split of a forced text: a step on, then as its canonical sibling
                value[c] = one_step[c] + value[tree.beside[c]]
        terms = [float(log_law[j, e]) for e in eos if masks[j, e]]
        terms += [float(log_law[j, tree.tokens[c]]) + value[c] for c in children[j]]
        value[j] = torch.logsumexp(torch.tensor(terms, dtype=torch.float64), 0).item()
    tilts = {}
    for j, kids in children.items():
        # A split not read is tilted as the word it begins: "B" as "Blue", the splits of a forced text alike.
        read = {tree.tokens[c]: value[c] for c in kids}
        tilts[tuple(tree.path(j))] = tuple((t, read[c]) for t, c in tree.aliases[j].items() if c in read)
    return value[0], tilts


def past(tilts: Tilts, token: int) -> Tilts:
    """The tilts after ``token`` is drawn: the paths through it, one token shorter."""
    return {path[1:]: tilt for path, tilt in tilts.items() if path[:1] == (token,)}
