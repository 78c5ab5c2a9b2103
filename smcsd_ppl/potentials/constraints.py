"""Hard constraints over token sequences: the ``Constraint`` base class.

A constraint answers one question fast: which tokens may follow each of several
contexts (``next_mask``). EOS tokens are allowed exactly where the context is a
complete string of the constraint's language. The implementations:

* ``RegexConstraint`` and ``JsonSchemaConstraint`` (``potentials.grammar``): compiled
  against the LM's tokenizer by llguidance; the masks of all contexts computed together.
* ``PotentialConstraint`` (below): any genlm-control ``Potential`` over bytes (a CFG, a
  product, your own), coerced to token ids with genlm-control's own coercion; exact for
  any potential, but its masks cost a ``batch_logw_next`` call.
* Your own: subclass ``Constraint`` and define ``next_mask``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


class Constraint:
    """Base class of hard constraints, shared by all particles of a run and never copied.

    A subclass must define ``next_mask``. ``allows`` and ``is_complete`` have defaults
    built on it; override them where the constraint answers more cheaply than a full mask
    (critic mode calls ``allows`` for every prefix of every block). Keep a constraint
    stateless with respect to particles: caches keyed by context are fine.

    Args:
        vocab_size: V, the width of the masks (None: not declared).
        eos_token_ids: the tokens that end an output; ``is_complete`` needs them.
    """

    vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    weighted: bool = False  # its allowed tokens carry log-weights (a soft potential), not only 0
    default_twist: str | None = None  # the twist ``SMCConfig(twist="auto")``, the default, gives it

    def __init__(self, vocab_size: int | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted({int(e) for e in eos_token_ids}))

    def next_mask(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Allowed next tokens ``[n, V]`` (bool) after each context; EOS only after a complete output.

        A context the constraint would not let through (or one holding an EOS) allows nothing.
        """
        raise NotImplementedError(f"{type(self).__name__} must define next_mask(contexts)")

    def next_log_weights(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Log-weight of each next token ``[n, V]`` (float): -inf where not allowed.

        A hard constraint's allowed tokens weigh 0 (the default); a ``weighted`` one's finite
        log-weights multiply the target: its outputs follow p(y) times their product.
        """
        return torch.where(self.next_mask(contexts), 0.0, float("-inf"))

    def forced_tokens(self, context: Sequence[int]) -> list[int]:
        """The canonical tokens of the text that must follow ``context`` (none by default).

        Where the constraint fixes the next characters, any of their tokenizations is allowed;
        a twist reads the canonical one to see how likely the forced text is.
        """
        return []

    def word_start(self, context: Sequence[int], token: int) -> int:
        """The canonical first token of the text ``token`` begins after ``context`` (``token`` by default).

        Where ``token`` is a word's uncommon split ("M" of "Marseille"), the word's own first
        token carries its mass; a twist reads that one.
        """
        return token

    def allows(self, sequences: Sequence[Sequence[int]]) -> list[bool]:
        """Whether each sequence is a viable prefix, or a complete output followed by EOS.

        The default reads one mask per sequence (after all its tokens but the last).
        """
        seqs = [list(s) for s in sequences]
        out = [True] * len(seqs)  # the empty sequence is every output's prefix
        idx = [i for i, s in enumerate(seqs) if s]
        if idx:
            masks = self.next_mask([seqs[i][:-1] for i in idx])  # [n, V]
            last = torch.tensor([seqs[i][-1] for i in idx], dtype=torch.long)
            for i, ok in zip(idx, masks[torch.arange(len(idx)), last.to(masks.device)].tolist()):
                out[i] = bool(ok)
        return out

    def is_complete(self, context: Sequence[int]) -> bool:
        """Whether ``context`` is a complete output (an EOS may follow it)."""
        if not self.eos_token_ids:
            raise NotImplementedError(
                f"{type(self).__name__} declares no eos_token_ids: pass them to Constraint.__init__ "
                "or define is_complete(context)"
            )
        mask = self.next_mask([list(context)])[0]
        return bool(mask[list(self.eos_token_ids)].any())


def token_bytes(tokenizer) -> tuple[list[bytes | None], list[int]]:
    """Byte string of every token id (None for special tokens) and the special ids.

    Special tokens are the tokenizer's special ids and every added token marked special
    (control tokens a decoder with ``skip_special_tokens`` drops): they are never text.
    """
    from genlm.backend.tokenization import decode_vocab

    byte_vocab = decode_vocab(tokenizer)[0]
    special = special_ids(tokenizer)
    out = [None if i in special else bytes(t) for i, t in enumerate(byte_vocab)]
    return out, sorted(special)


def special_ids(tokenizer) -> set[int]:
    """The tokenizer's special ids and its added tokens marked special."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return special | {int(i) for i, t in added.items() if getattr(t, "special", False)}


class PotentialConstraint(Constraint):
    """Any genlm-control ``Potential`` over bytes, as a (weighted) constraint on token ids.

    The potential is coerced to the LM's vocabulary (``b"".join`` of token bytes); a token is
    allowed where the coerced potential's next-token weight is finite, and that finite weight
    multiplies the target (0 for a Boolean potential such as ``BoolFSA``: a hard constraint).

    Args:
        potential: a genlm-control potential whose vocabulary is bytes (ints 0-255).
        tokenizer: the LM's tokenizer.
        eos_token_ids: tokens that end the output (the potential's EOS).
        weighted: whether its finite weights matter (None: yes, unless it is one of
            genlm-control's Boolean potentials, ``BoolFSA`` or ``BoolCFG``, whose weights are
            all 0). A weighted constraint costs a weights call at every drafted position.
    """

    def __init__(
        self, potential, tokenizer, eos_token_ids: Sequence[int], weighted: bool | None = None
    ) -> None:
        from genlm.backend.tokenization import decode_vocab
        from genlm.control.potential.coerce import Coerced

        super().__init__(None, eos_token_ids)
        if weighted is None:
            from genlm.control import BoolCFG, BoolFSA

            weighted = not isinstance(potential, (BoolFSA, BoolCFG))
        self.weighted = weighted
        self.vocab_tokens = list(decode_vocab(tokenizer)[0])
        self.vocab_size = len(self.vocab_tokens)
        # Pruning keeps only tokens whose bytes the potential can ever accept (for a
        # grammar over digits and operators, a few hundred of 49k): masks get that cheap.
        self.coerced = Coerced(potential, self.vocab_tokens, f=b"".join, prune=True)
        special = special_ids(tokenizer)
        ids = [t.token_id for t in self.coerced.vocab]
        keep = [n for n, i in enumerate(ids) if i not in special]
        self._columns = torch.tensor(keep, dtype=torch.long)  # text tokens among the coerced vocab
        self._ids = torch.tensor([ids[n] for n in keep], dtype=torch.long)  # and their token ids
        self._eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}  # context -> next-token log-weights [V]

    def next_mask(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Allowed next tokens ``[n, V]``: where the coerced potential's ``logw_next`` is finite."""
        return torch.isfinite(self.next_log_weights(contexts))

    def next_log_weights(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The coerced potential's next-token log-weights ``[n, V]`` (-inf: not allowed)."""
        todo = [c for c in dict.fromkeys(tuple(int(t) for t in c) for c in contexts) if c not in self._cache]
        eos = set(self._eos.tolist())
        # Dead contexts (past an EOS or off the language) allow nothing; genlm-control
        # refuses to compute next-token weights for them.
        live = [c for c, ok in zip(todo, self.allows(todo)) if ok and not (set(c) & eos)]
        for c in todo:
            self._cache[c] = torch.full((self.vocab_size,), float("-inf"))
        if live:
            batch = _run(self.coerced.batch_logw_next([[self.vocab_tokens[t] for t in c] for c in live]))
            weights = torch.as_tensor(np.asarray(batch.weights), dtype=torch.float32)  # [n, V+1]
            for c, w in zip(live, weights):
                out = torch.full((self.vocab_size,), float("-inf"))
                out[self._ids] = w[self._columns]
                out[self._eos] = w[-1]  # the coerced vocabulary ends with EOS
                self._cache[c] = out
        return torch.stack([self._cache[tuple(int(t) for t in c)] for c in contexts])

    def allows(self, sequences: Sequence[Sequence[int]]) -> list[bool]:
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
