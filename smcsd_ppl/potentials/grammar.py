"""Regexes and JSON schemas compiled by llguidance against the LM's tokenizer.

llguidance (a maintained Rust engine, MIT) turns a grammar into a token-level matcher:
building one costs milliseconds and a mask over the whole vocabulary microseconds; large
batches of masks run on its thread pool (``docs/constraints.md`` measures it against
outlines-core and xgrammar). A ``GrammarConstraint`` keeps one matcher per
context it has seen (a prefix tree of copies: extending a context by a token is a copy
and one step), so the masks of a block's positions and of resampled particles reuse the
parser states their prefixes already reached.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from .constraints import Constraint, token_bytes
from .lark import EXACT, regex_grammar, schema_grammar
from .schema import check_schema, engine_error

MAX_CACHED_CONTEXTS = 50_000  # parser states kept per constraint; past that the tree restarts
PARALLEL_MASKS = 16  # masks per call from which the engine's thread pool computes them
_THREADS = max(1, min(32, (os.cpu_count() or 1) * 4 // 5))  # the pool's size (the engine's own rule)
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_EXECUTOR = None


def engine_tokenizer(tokenizer, eos_token_ids: Sequence[int], vocab_size: int | None = None):
    """The tokenizer as llguidance reads it (built once per tokenizer, EOS set and width).

    A fast HF tokenizer is read from its own serialization; any other from the token
    bytes genlm-control decodes (byte-level BPE or SentencePiece).
    """
    import llguidance
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    key = (tuple(eos_token_ids), vocab_size)
    with _LOCK:
        per = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in per:
            eos = list(eos_token_ids)
            if isinstance(tokenizer, PreTrainedTokenizerFast):
                per[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
            else:
                wrapper = llguidance.TokenizerWrapper(_ByteTokenizer(tokenizer, eos[0]))
                per[key] = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
        return per[key]


class _ByteTokenizer:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, EOS, special ids, an encoder."""

    def __init__(self, tokenizer, eos: int) -> None:
        vocab, special = token_bytes(tokenizer)
        self.tokens = [b"<special %d>" % i if b is None else b for i, b in enumerate(vocab)]
        self.special_token_ids, self.eos_token_id, self.bos_token_id = special, eos, None
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def mask_executor():
    """One llguidance thread pool for every constraint (large batches of masks run in parallel)."""
    global _EXECUTOR
    with _LOCK:
        if _EXECUTOR is None:
            import llguidance

            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


def fill_bitmasks(matchers: Sequence[tuple[object, int]], bits: np.ndarray) -> None:
    """Write the mask of each (matcher, row) into row ``row`` of ``bits [n, W]`` (int32 words).

    Large batches go to the engine's thread pool where it has more than one thread; below
    that, its dispatch costs more than the masks.
    """
    row_bytes = bits.shape[1] * 4
    if len(matchers) >= PARALLEL_MASKS and _THREADS > 1:
        mask_executor().unsafe_compute_mask_ptr(list(matchers), bits.ctypes.data, row_bytes, len(bits))
    else:
        for m, i in matchers:
            m.unsafe_compute_mask_ptr(bits.ctypes.data + i * row_bytes, row_bytes)


class GrammarConstraint(Constraint):
    """The outputs of a grammar in llguidance's Lark dialect (regex lexemes, ``%json`` rules).

    Args:
        grammar: the grammar's Lark text (``start`` is its start rule).
        tokenizer: the LM's tokenizer.
        eos_token_ids: tokens that end the output; allowed only after a complete one.
        vocab_size: width of the masks when the LM has more logits than the tokenizer tokens.
        name: how errors name the grammar (``regex '...'``, ``JSON schema``).

    Raises:
        ValueError: the grammar does not compile, or no output satisfies it.
    """

    def __init__(
        self, grammar: str, tokenizer, eos_token_ids: Sequence[int], *, vocab_size=None, name="grammar"
    ) -> None:
        import llguidance

        super().__init__(vocab_size, eos_token_ids)
        if not self.eos_token_ids:
            raise ValueError(f"{name}: give at least one EOS token id (the output ends there)")
        self._tokenizer = engine_tokenizer(tokenizer, self.eos_token_ids, vocab_size)
        self.vocab_size = self._tokenizer.vocab_size
        self._words = (self.vocab_size + 31) // 32  # int32 words of one bitmask row
        grammar = llguidance.LLMatcher.grammar_from_lark(EXACT + grammar)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise ValueError(f"cannot compile {name}: {engine_error(messages[0])}")
        root = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if root.is_error():
            raise ValueError(f"cannot compile {name}: {engine_error(root.get_error())}")
        self.grammar, self.name = grammar, name
        self._eos = set(self.eos_token_ids)
        self._root = root
        self._matchers: dict[tuple[int, ...], object] = {(): root}
        if not self.next_mask([()])[0].any():
            raise ValueError(f"{name} is unsatisfiable: no output (not even an empty one) matches it")

    def next_mask(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Allowed next tokens ``[n, V]``, computed once per distinct context, unpacked in one go."""
        keys = [tuple(int(t) for t in c) for c in contexts]
        unique = list(dict.fromkeys(keys))
        out = self._masks([self._matcher(k) for k in unique])  # [unique, V]
        if len(unique) == len(keys):
            return out
        row = {k: i for i, k in enumerate(unique)}
        return out[torch.tensor([row[k] for k in keys], dtype=torch.long)]

    def allows(self, sequences: Sequence[Sequence[int]]) -> list[bool]:
        """Each sequence is a viable prefix (or a complete output followed by EOS).

        The engine consumes some tokens its own mask refuses (ones leading into a dead end):
        a prefix is viable only where its state's mask allows something, so ``allows``
        agrees with ``next_mask``. Those masks are computed together, once per state.
        """
        keys = [tuple(int(t) for t in s) for s in sequences]
        ends = [bool(k) and k[-1] in self._eos for k in keys]
        matchers = [self._matcher(k[:-1] if e else k) for k, e in zip(keys, ends)]
        out = [m is not None and m.is_accepting() if e else m is not None for m, e in zip(matchers, ends)]
        prefixes = {id(m): m for m, e, ok in zip(matchers, ends, out) if ok and not e}
        if prefixes:
            viable = self._masks(list(prefixes.values())).any(1).tolist()
            alive = {i: v for i, v in zip(prefixes, viable)}
            out = [ok and (e or alive[id(m)]) for m, e, ok in zip(matchers, ends, out)]
        return out

    def _masks(self, matchers: list) -> torch.Tensor:
        """The masks ``[n, V]`` of parser states (None: a dead context, nothing allowed)."""
        bits = np.zeros((len(matchers), self._words), dtype=np.int32)
        live = [(m, i) for i, m in enumerate(matchers) if m is not None]
        fill_bitmasks(live, bits)
        masks = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        out = torch.from_numpy(masks.view(np.bool_))
        # Where no text may follow, the engine's mask holds EOS alone, complete or not (and the
        # matcher is then in error): EOS is allowed exactly where the output is complete.
        for m, i in live:
            if m.is_error() or m.is_stopped():
                out[i] = False
                out[i, list(self.eos_token_ids)] = m.is_accepting() and not m.is_error()
        return out

    def forced_tokens(self, context: Sequence[int]) -> list[int]:
        """The canonical tokenization of the text the grammar forces after ``context`` (may be empty)."""
        m = self._matcher(tuple(int(t) for t in context))
        if m is None or m.is_error() or m.is_stopped():
            return []
        tokens = self._tokenizer.tokenize_bytes(m.compute_ff_bytes())
        return tokens[: m.validate_tokens(tokens)]  # a last token the state refuses is not forced

    def word_start(self, context: Sequence[int], token: int) -> int:
        """The canonical first token of ``token``'s text and the text forced after it."""
        key = tuple(int(t) for t in context)
        before, after = self._matcher(key), self._matcher((*key, int(token)))
        if before is None or after is None or after.is_error() or after.is_stopped():
            return token
        text = self._tokenizer.decode_bytes([int(token)]) + after.compute_ff_bytes()
        first = self._tokenizer.tokenize_bytes(text)[:1]
        return first[0] if first and before.validate_tokens(first) == 1 else token

    def is_complete(self, context: Sequence[int]) -> bool:
        """The context is a complete output of the grammar."""
        m = self._matcher(tuple(int(t) for t in context))
        return m is not None and m.is_accepting()

    def _matcher(self, key: tuple[int, ...]):
        """The parser state after ``key`` (None once no output can start with it), every prefix cached."""
        m = self._matchers.get(key, self)  # `self` marks a miss: None is a cached dead end
        if m is not self:
            return m
        if len(self._matchers) > MAX_CACHED_CONTEXTS:  # bound memory on very long runs
            self._matchers = {(): self._root}
        n = len(key) - 1
        while key[:n] not in self._matchers:  # the longest prefix already walked
            n -= 1
        m = self._matchers[key[:n]]
        for i in range(n, len(key)):
            if m is not None:
                token, m = key[i], m.deep_copy()  # cached states are never changed in place
                if token in self._eos or not 0 <= token < self.vocab_size or not m.consume_token(token):
                    m = None  # an EOS ends the output: nothing may follow it
            self._matchers[key[: i + 1]] = m
        return m


class RegexConstraint(GrammarConstraint):
    """Token sequences whose text matches a regular expression (Python ``re`` syntax, no lookaround).

    Matching is over the UTF-8 text of the tokens; a token that splits a character is
    allowed where the character can still be completed.

    Args:
        pattern: the regex the whole output must match (a prefix of it while generating).
        tokenizer: the LM's tokenizer (a fast HF tokenizer, byte-level BPE or SentencePiece).
        eos_token_ids: tokens that end the output; allowed only on a full match.
        vocab_size: width of the masks, when the LM has more logits than the tokenizer tokens.

    Raises:
        ValueError: the pattern does not compile, or matches nothing.
    """

    def __init__(self, pattern: str, tokenizer, eos_token_ids: Sequence[int], *, vocab_size=None) -> None:
        grammar = regex_grammar(pattern)
        self.pattern = pattern
        name = f"regex {pattern!r}"
        super().__init__(grammar, tokenizer, eos_token_ids, vocab_size=vocab_size, name=name)


class JsonSchemaConstraint(GrammarConstraint):
    """JSON texts valid under a JSON Schema, laid out as ``json.dumps`` does (one line).

    Covers nested objects, arrays (``items``, ``prefixItems``, ``minItems``, ``maxItems``),
    ``enum``/``const``, required and optional properties, ``additionalProperties``, string
    ``minLength``/``maxLength``/``pattern``/``format``, number bounds, ``anyOf``/``oneOf``/
    ``allOf`` and ``$ref``/``$defs``. Properties come in schema order.

    Args:
        schema: the JSON Schema (a dict, or its JSON text).
        tokenizer: the LM's tokenizer.
        eos_token_ids: tokens that end the output; allowed only after a complete value.
        separators: item and key separators (``json.dumps``'s default).
        vocab_size: width of the masks, when the LM has more logits than the tokenizer tokens.

    Raises:
        ValueError: a keyword is unknown or unsupported (named), or no value is valid.
    """

    # exact where the rest of the output is finite (an enum, an object of enums), no read where it
    # opens into free text, so it costs little on open JSON (docs/constraints.md)
    default_twist = "finite"

    def __init__(
        self,
        schema: dict | str,
        tokenizer,
        eos_token_ids: Sequence[int],
        *,
        separators: tuple[str, str] = (", ", ": "),
        vocab_size=None,
    ) -> None:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ValueError(f"the JSON schema is not valid JSON: {err}") from err
        check_schema(schema)
        self.schema = schema
        grammar = schema_grammar(schema, separators)
        super().__init__(grammar, tokenizer, eos_token_ids, vocab_size=vocab_size, name="JSON schema")
