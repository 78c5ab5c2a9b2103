"""Hard constraints over token sequences, evaluated for whole batches of particles.

A constraint answers one question fast: which tokens may follow each of several
contexts (``next_mask``). EOS tokens are allowed exactly where the context is a
complete string of the constraint's language. Two implementations:

* ``RegexConstraint`` compiles a regular expression to a byte DFA and, per DFA
  state, a table of the state every vocabulary token leads to (built once per
  state, vectorized over the vocabulary), so a mask is one table lookup.
* ``PotentialConstraint`` lifts any genlm-control ``Potential`` over bytes
  (``BoolFSA.from_regex``, ``BoolCFG.from_lark``, ``JsonSchema``, ...) to token ids
  with genlm-control's own coercion; exact for any potential, but its masks cost
  a ``batch_logw_next`` call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import numpy as np
import torch

DEAD = -1


@runtime_checkable
class Constraint(Protocol):
    """What the engine needs from a hard constraint.

    ``next_mask`` is required. A constraint may also define ``allows(sequences) ->
    list[bool]`` (each sequence is a viable prefix, or complete when it ends with
    EOS), which critic mode uses instead of full masks when it is cheaper.
    """

    def next_mask(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Allowed next tokens ``[n, V]`` (bool) after each context of token ids."""


def allows(constraint: Constraint, sequences: Sequence[Sequence[int]]) -> list[bool]:
    """Whether each token sequence can still satisfy the constraint (see ``Constraint``)."""
    if hasattr(constraint, "allows"):
        return list(constraint.allows(sequences))
    masks = constraint.next_mask([s[:-1] for s in sequences])
    return [bool(m[s[-1]]) if s else True for m, s in zip(masks, sequences)]


def token_bytes(tokenizer) -> tuple[list[bytes | None], list[int]]:
    """Byte string of every token id (None for special tokens) and the special ids."""
    from genlm.backend.tokenization import decode_vocab

    byte_vocab = decode_vocab(tokenizer)[0]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out = [None if i in special else bytes(t) for i, t in enumerate(byte_vocab)]
    return out, sorted(special)


class RegexConstraint:
    """Token sequences whose bytes match a regular expression (Python ``re`` syntax).

    Matching is over bytes: ASCII patterns behave exactly as over text; a
    non-ASCII byte counts as one character that only negated classes and ``.``
    accept.

    Args:
        pattern: the regex the whole output must match (a prefix of it while generating).
        tokenizer: the LM's tokenizer (byte-level BPE or SentencePiece).
        eos_token_ids: tokens that end the output; allowed only on a full match.
    """

    def __init__(self, pattern: str, tokenizer, eos_token_ids: Sequence[int]) -> None:
        import interegular

        wide = next((c for c in pattern if ord(c) > 127), None)
        if wide is not None:  # it would match no byte, and the constraint would allow nothing
            raise ValueError(
                f"regex {pattern!r} holds the non-ASCII character {wide!r}: constraints match bytes, "
                "where only '.' and negated classes cover non-ASCII text; write it with those"
            )
        try:
            fsm = interegular.parse_pattern(pattern).to_fsm()
        except Exception as err:  # interegular raises its own parse errors
            raise ValueError(f"cannot compile regex {pattern!r}: {err}") from err
        self.pattern = pattern
        self._trans, self._start, self._finals = _byte_dfa(fsm)
        vocab, special = token_bytes(tokenizer)
        self.vocab_size = len(vocab)
        self._order, self._bytes, self._active = _sorted_bytes(vocab)
        self._special = np.array(special, dtype=np.int64)
        self._eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self._eos_set = set(self._eos.tolist())
        self._tables: dict[int, np.ndarray] = {}  # DFA state -> next state of every token
        self._masks: dict[int, torch.Tensor] = {}
        self._states: dict[tuple[int, ...], int] = {(): self._start}

    def state(self, context: Sequence[int]) -> int:
        """DFA state after a token sequence (``DEAD`` once it cannot match)."""
        key = tuple(int(t) for t in context)
        n = len(key)
        while key[:n] not in self._states:  # the longest prefix already walked
            n -= 1
        s = self._states[key[:n]]
        if len(self._states) > 500_000:  # bound memory on very long runs
            self._states = {(): self._start}
        for i in range(n, len(key)):
            s = DEAD if s == DEAD else int(self._table(s)[key[i]])
            self._states[key[: i + 1]] = s
        return s

    def next_mask(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Allowed next tokens ``[n, V]``; EOS only where the match is complete."""
        return torch.stack([self._mask(self.state(c)) for c in contexts])

    def is_complete(self, context: Sequence[int]) -> bool:
        """The context's bytes match the whole pattern."""
        return self.state(context) in self._finals

    def allows(self, sequences: Sequence[Sequence[int]]) -> list[bool]:
        """Each sequence is a viable prefix (or a full match followed by EOS)."""
        out = []
        for seq in sequences:
            if seq and int(seq[-1]) in self._eos_set:
                out.append(self.is_complete(seq[:-1]))
            else:
                out.append(self.state(seq) != DEAD)
        return out

    def _mask(self, state: int) -> torch.Tensor:
        mask = self._masks.get(state)
        if mask is None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            if state != DEAD:
                mask = torch.from_numpy(self._table(state) != DEAD)
                if state in self._finals:
                    mask[self._eos] = True
            self._masks[state] = mask
        return mask

    def _table(self, state: int) -> np.ndarray:
        table = self._tables.get(state)
        if table is None:
            # Walk every token's bytes at once from `state`. Tokens are sorted by
            # length, so position `pos` touches only the tokens that long.
            cur = np.full(len(self._order), state, dtype=np.int64)
            for pos, n in enumerate(self._active):
                head = cur[:n]
                live = head != DEAD
                head[live] = self._trans[head[live], self._bytes[:n, pos][live]]
            table = np.full(self.vocab_size, DEAD, dtype=np.int64)
            table[self._order] = cur
            table[self._special] = DEAD  # special tokens are never text
            self._tables[state] = table
        return table


def _byte_dfa(fsm) -> tuple[np.ndarray, int, set[int]]:
    """The character DFA of interegular as a ``[states, 256]`` byte transition table."""
    from interegular.fsm import anything_else

    states = sorted(fsm.states)
    index = {s: i for i, s in enumerate(states)}
    other = fsm.alphabet[anything_else] if anything_else in fsm.alphabet else None
    trans = np.full((len(states), 256), DEAD, dtype=np.int64)
    for s in states:
        arcs = fsm.map.get(s, {})
        for b in range(256):
            ch = chr(b) if b < 128 else None
            symbol = fsm.alphabet[ch] if ch is not None and ch in fsm.alphabet else other
            if symbol is not None and symbol in arcs:
                trans[index[s], b] = index[arcs[symbol]]
    return trans, index[fsm.initial], {index[f] for f in fsm.finals}


def _sorted_bytes(vocab: list[bytes | None]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Token ids by decreasing byte length, their byte matrix, and counts per position.

    Returns the order, the ``[V, L]`` byte matrix in that order, and how many tokens
    are longer than each position.
    """
    lengths = np.array([0 if t is None else len(t) for t in vocab], dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    width = max(1, int(lengths.max()))
    out = np.zeros((len(vocab), width), dtype=np.int64)
    for row, i in enumerate(order):
        t = vocab[i]
        if t:
            out[row, : len(t)] = np.frombuffer(t, dtype=np.uint8)
    active = [int((lengths > pos).sum()) for pos in range(width)]
    return order, out, active


class PotentialConstraint:
    """Any genlm-control ``Potential`` over bytes, as a constraint on token ids.

    The potential is coerced to the LM's vocabulary (``b"".join`` of token bytes);
    a token is allowed where the coerced potential's next-token weight is finite.

    Args:
        potential: a genlm-control potential whose vocabulary is bytes (ints 0-255).
        tokenizer: the LM's tokenizer.
        eos_token_ids: tokens that end the output (the potential's EOS).
    """

    def __init__(self, potential, tokenizer, eos_token_ids: Sequence[int]) -> None:
        from genlm.backend.tokenization import decode_vocab
        from genlm.control.potential.coerce import Coerced

        self.vocab_tokens = list(decode_vocab(tokenizer)[0])
        self.vocab_size = len(self.vocab_tokens)
        # Pruning keeps only tokens whose bytes the potential can ever accept (for a
        # grammar over digits and operators, a few hundred of 49k): masks get that cheap.
        self.coerced = Coerced(potential, self.vocab_tokens, f=b"".join, prune=True)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids = [t.token_id for t in self.coerced.vocab]
        keep = [n for n, i in enumerate(ids) if i not in special]
        self._columns = torch.tensor(keep, dtype=torch.long)  # text tokens among the coerced vocab
        self._ids = torch.tensor([ids[n] for n in keep], dtype=torch.long)  # and their token ids
        self._eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def next_mask(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Allowed next tokens ``[n, V]`` from the coerced potential's ``logw_next``."""
        todo = [c for c in dict.fromkeys(tuple(int(t) for t in c) for c in contexts) if c not in self._cache]
        eos = set(self._eos.tolist())
        # Dead contexts (past an EOS or off the language) allow nothing; genlm-control
        # refuses to compute next-token weights for them.
        live = [c for c, ok in zip(todo, self.allows(todo)) if ok and not (set(c) & eos)]
        for c in todo:
            self._cache[c] = torch.zeros(self.vocab_size, dtype=torch.bool)
        if live:
            batch = _run(self.coerced.batch_logw_next([[self.vocab_tokens[t] for t in c] for c in live]))
            weights = torch.as_tensor(np.asarray(batch.weights), dtype=torch.float64)  # [n, V+1]
            for c, w in zip(live, weights):
                mask = torch.zeros(self.vocab_size, dtype=torch.bool)
                mask[self._ids] = torch.isfinite(w[self._columns])
                if torch.isfinite(w[-1]):  # the coerced vocabulary ends with EOS
                    mask[self._eos] = True
                self._cache[c] = mask
        return torch.stack([self._cache[tuple(int(t) for t in c)] for c in contexts])


def _potential_allows(self, sequences: Sequence[Sequence[int]]) -> list[bool]:
    """Viable prefix (``batch_prefix``), or complete before a final EOS (``batch_complete``)."""
    eos = set(self._eos.tolist())
    ends = [bool(s) and int(s[-1]) in eos for s in sequences]
    bodies = [[self.vocab_tokens[t] for t in (s[:-1] if e else s)] for s, e in zip(sequences, ends)]
    out = [True] * len(sequences)
    for want_complete in (False, True):
        idx = [i for i, e in enumerate(ends) if e == want_complete]
        if idx:
            call = self.coerced.batch_complete if want_complete else self.coerced.batch_prefix
            weights = _run(call([bodies[i] for i in idx]))
            for i, w in zip(idx, weights):
                out[i] = bool(np.isfinite(float(w)))
    return out


PotentialConstraint.allows = _potential_allows


def _run(coro):
    """Run a genlm-control coroutine from synchronous engine code.

    The engine's batched calls run inside the SMC loop's event loop, where a nested
    ``asyncio.run`` is not allowed: then the coroutine runs on a worker thread's loop.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    return _WORKER.submit(asyncio.run, coro).result()


_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smcsd-potential")
