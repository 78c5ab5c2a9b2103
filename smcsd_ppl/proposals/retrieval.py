"""Training-free retrieval drafting (RACER): n-gram automaton + logit cues.

``NGramIndex`` holds every token substring of length <= n (n = 10) of the prompts
and of everything generated, as a trie with occurrence counts. Because *all*
substrings are inserted, the Aho-Corasick fail link of node(s) is simply
node(s[1:]), which always exists and is known when the node is created: no
rebuild pass, and the fail chain of the context's match is exactly the set of
its matching suffixes. We chose this over a suffix automaton because the trie
gives per-n-gram frequencies directly (a suffix automaton needs a pass over its
suffix links to count occurrences) and supports LRU eviction: a suffix automaton
cannot delete states, so it could not stay capped across requests.

``LogitCues`` is the vocab x k table of the top-k target predictions last seen
after each token. ``RetrievalDrafter.build_draft_tree`` merges both into one
token tree per step. SMC-SD's retrieval proposals (``proposals.blocks``) walk the same
index, one per request.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class _Node:
    __slots__ = ("children", "count", "stamp", "fail", "token", "depth")

    def __init__(self, token: int, depth: int, fail: _Node | None) -> None:
        self.children: dict[int, _Node] = {}
        self.count, self.stamp = 0, 0
        self.token, self.depth, self.fail = token, depth, fail


class NGramIndex:
    """Trie of all token n-grams (length <= n) seen, with counts, fail links and an LRU cap.

    Args:
        n: longest n-gram stored.
        max_nodes: when passed, the least recently seen n-grams are evicted down to half.
    """

    def __init__(self, n: int = 10, max_nodes: int = 200_000) -> None:
        if n < 2 or max_nodes < 16:
            raise ValueError(f"need n >= 2 and max_nodes >= 16, got n={n}, max_nodes={max_nodes}")
        self.n, self.max_nodes = n, max_nodes
        self.root = _Node(-1, 0, None)
        self.root.fail = self.root
        self.size, self.clock, self.floor = 1, 0, 0

    def feed(self, active: list[_Node], tokens: Sequence[int]) -> list[_Node]:
        """Append ``tokens`` to a document; ``active`` (``[]`` for a new one) is returned updated.

        ``active`` holds the nodes of the document's suffixes of length 1..n, shortest first.
        """
        # Nodes stamped below the floor were evicted; a shorter suffix is always at least
        # as recent as a longer one, so the survivors stay a contiguous shortest-first run.
        active = [a for a in active if a.stamp >= self.floor]
        for t in tokens:
            self.clock += 1
            new: list[_Node] = []
            for a in [self.root, *active]:
                if a.depth >= self.n:
                    break
                child = a.children.get(t)
                if child is None:  # its fail link, node(s[1:] + t), was made just before
                    child = a.children[t] = _Node(t, a.depth + 1, new[-1] if new else self.root)
                    self.size += 1
                child.count += 1
                # Touching the parent keeps "parent at least as recent as child" for eviction.
                child.stamp = a.stamp = self.clock
                new.append(child)
            active = new
        if self.size > self.max_nodes:
            self._evict()
        return active

    def _evict(self) -> None:
        """Drop the least recently seen half: children and suffixes are never more recent."""
        stamps, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stamps.extend(c.stamp for c in node.children.values())
            stack.extend(node.children.values())
        stamps.sort()
        self.floor = stamps[len(stamps) // 2] + 1
        self.size, stack = 1, [self.root]
        while stack:
            node = stack.pop()
            node.children = {t: c for t, c in node.children.items() if c.stamp >= self.floor}
            self.size += len(node.children)
            stack.extend(node.children.values())

    def step(self, node: _Node, token: int) -> _Node:
        """Aho-Corasick transition: the longest suffix of (node's string + token) in the trie."""
        while True:
            child = node.children.get(token)
            if child is not None:
                return child
            if node is self.root:
                return node
            node = node.fail

    def match(self, context: Sequence[int]) -> _Node:
        """Node of the longest suffix (<= n tokens) of ``context`` in the trie (read-only)."""
        node = self.root
        for t in list(context)[-self.n :]:
            node = self.step(node, t)
        return node

    def suffixes(self, node: _Node, min_depth: int = 2) -> list[_Node]:
        """``node`` and its fail chain down to ``min_depth`` tokens, longest first."""
        out = []
        while node.depth >= min_depth:
            out.append(node)
            node = node.fail
        return out

    def continuations(self, node: _Node, min_depth: int = 2) -> dict[int, float] | None:
        """What followed the longest suffix (>= ``min_depth`` tokens) of ``node`` that has continuations.

        Token -> share of its occurrences; ``None`` when no such suffix was ever continued.
        """
        for border in self.suffixes(node, min_depth):
            if border.children:
                total = sum(c.count for c in border.children.values())
                return {t: c.count / total for t, c in border.children.items()}
        return None


class LogitCues:
    """Table ``[V, k]``: the top-k target predictions last seen after each token (-1 = unseen)."""

    def __init__(self, vocab_size: int, k: int = 8) -> None:
        self.k = min(k, vocab_size)
        self.table = torch.full((vocab_size, self.k), -1, dtype=torch.int32)

    def update(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Record ``topk(logits[i])`` as what follows ``tokens[i]`` (``[N]``, ``[N, V]``)."""
        if tokens.numel():
            self.record(tokens, torch.topk(logits, self.k, dim=-1).indices)

    def record(self, tokens: torch.Tensor, top: torch.Tensor) -> None:
        """Store precomputed top-k ids ``top [N, k]`` after ``tokens [N]`` (one of duplicates wins)."""
        self.table[tokens.reshape(-1).cpu()] = top.reshape(-1, self.k).to("cpu", torch.int32)

    def row(self, token: int) -> list[int]:
        """Cues after ``token``, best first (empty if never seen)."""
        row = self.table[token]
        return [] if int(row[0]) < 0 else row.tolist()


@dataclass
class DraftTree:
    """A token tree: node 0 is the root; ``parents[j] < j`` (-1 for the root)."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depth: list[int] = field(default_factory=lambda: [0])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> tuple[int, bool]:
        """Child ``token`` of ``parent`` (siblings stay distinct); returns (index, created)."""
        j = self.children[parent].get(token)
        if j is not None:
            return j, False
        j = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.children.append({})
        self.children[parent][token] = j
        return j, True


class RetrievalDrafter:
    """RACER's drafter: an ``NGramIndex`` and ``LogitCues`` shared by all requests of a run.

    Args:
        vocab_size: V of the target.
        n: longest n-gram indexed.
        k: cues per token.
        max_nodes: LRU cap of the index.
        min_match: shortest suffix match (root included) whose continuations are used.
    """

    def __init__(
        self, vocab_size: int, *, n: int = 10, k: int = 8, max_nodes: int = 200_000, min_match: int = 2
    ):
        self.index = NGramIndex(n, max_nodes)
        self.cues = LogitCues(vocab_size, k)
        self.min_match = min_match

    def build_draft_tree(
        self, context: Sequence[int], budget: int = 64, max_depth: int | None = None
    ) -> DraftTree:
        """Draft tree rooted at ``context[-1]`` (the next token, already drawn from the target).

        Retrieval first: continuations of every matching suffix, most frequent first
        (best-first, so a node always follows its parent; past n tokens a continuation
        goes on through fail links). Then breadth-first from the
        logit cues, the root with breadth k and the i-th child of a node of breadth b
        with breadth max(1, b / 2^(i+1)) (the root's children start at k), until
        ``budget`` nodes. No node is deeper than ``max_depth``.
        """
        if budget < 1 or not context:
            raise ValueError("build_draft_tree needs a non-empty context and budget >= 1")
        max_depth = budget if max_depth is None else max_depth
        tree = DraftTree([int(context[-1])])
        heap: list = []
        seq = 0  # tie-breaker: equal counts keep insertion order (longer matches first)
        for border in self.index.suffixes(self.index.match(context), self.min_match):
            for child in border.children.values():
                heap.append((-child.count, seq, child, 0))
                seq += 1
        heapq.heapify(heap)
        pops = 0
        while heap and len(tree) < budget and pops < 8 * budget:
            _, _, node, parent = heapq.heappop(heap)
            pops += 1
            if tree.depth[parent] >= max_depth:
                continue
            j, _ = tree.add(parent, node.token)
            # A full-length n-gram has no children: continue from its (n-1)-token suffix,
            # so copied passages are not cut at n - match length tokens.
            nxt = node.children if node.children or node.depth < self.index.n else node.fail.children
            for child in nxt.values():
                heapq.heappush(heap, (-child.count, seq, child, j))
                seq += 1
        queue = deque([(0, self.cues.k)])
        while queue and len(tree) < budget:
            node, breadth = queue.popleft()
            if tree.depth[node] >= max_depth:
                continue
            nxt = breadth if node == 0 else breadth >> 1
            for token in self.cues.row(tree.tokens[node])[:breadth]:
                if len(tree) >= budget:
                    break
                j, _ = tree.add(node, token)
                queue.append((j, max(1, nxt)))
                nxt >>= 1
        return tree

    def next_token_probs(self, node: _Node, last: int) -> dict[int, float] | None:
        """Retrieval's next-token distribution after a context matched at ``node``, ending in ``last``.

        Counts of the longest matching suffix that has continuations; else the
        logit cues after ``last`` with weights 2^-rank; ``None`` if neither exists.
        """
        found = self.index.continuations(node, self.min_match)
        if found is not None:
            return found
        cues = self.cues.row(last)
        if not cues:
            return None
        weights = {}
        for rank, t in enumerate(cues):
            weights[t] = weights.get(t, 0.0) + 2.0**-rank
        total = sum(weights.values())
        return {t: w / total for t, w in weights.items()}
