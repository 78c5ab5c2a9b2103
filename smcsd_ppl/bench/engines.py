"""Grammar engines side by side: build time, batched mask time, JSON Schema coverage, licence.

``smcsd constraint-engines`` runs this on the target's tokenizer; docs/constraints.md says
which engine compiles the constraints here and why. llguidance is measured through this
package's own constraints (what a user pays: checks, the first mask, every tokenization
allowed); outlines-core and xgrammar through their public APIs, when installed
(``pip install outlines-core xgrammar``; neither is a dependency). Masks are filled for a
batch of particles at different positions of one valid output and unpacked to ``[N, V]``
bool, the form the engine consumes.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from ..potentials import JsonSchemaConstraint, RegexConstraint, token_bytes
from ..potentials.grammar import engine_tokenizer, fill_bitmasks

DATE = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
FLAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "languages": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 1,
            "maxItems": 4,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "country": {"type": "string", "maxLength": 30},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "languages", "address"],
    "additionalProperties": False,
}
TASKS = {  # name -> (kind, spec, a valid output: the masks are taken along its tokens)
    "date regex": ("regex", DATE, "1969-07-20"),
    "3-field schema": ("json", FLAT, '{"name": "Maria Lopez", "age": 34, "city": "Madrid"}'),
    "nested schema": (
        "json",
        NESTED,
        '{"name": "Ana", "languages": ["Spanish", "English"], '
        '"address": {"city": "Lima", "country": "Peru"}}',
    ),
}
_OBJ = {"type": "object", "additionalProperties": False}
FEATURES = {  # feature -> (schema, a valid instance, an invalid one)
    "nested objects": (
        {**_OBJ, "properties": {"a": {**_OBJ, "properties": {"b": {"type": "integer"}}, "required": ["b"]}}},
        {"a": {"b": 1}},
        {"a": {"b": "x"}},
    ),
    "arrays minItems/maxItems": (
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
        [1, 2],
        [1, 2, 3],
    ),
    "enum": ({"enum": ["red", "green"]}, "red", "blue"),
    "const": ({"const": "x"}, "x", "y"),
    "required/optional": (
        {**_OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["b"]},
        {"b": 1},
        {"a": 1},
    ),
    "string minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
    "$ref/$defs": (
        {"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}},
        [1],
        ["x"],
    ),
    "recursive $ref": (
        {"$defs": {"t": {**_OBJ, "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}}}
        | {"$ref": "#/$defs/t"},
        {"c": [{"c": []}]},
        {"c": [{"d": 1}]},
    ),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, 3, 1),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
        [1, "a"],
        ["a", 1],
    ),
    "integer minimum/maximum": ({"type": "integer", "minimum": 10, "maximum": 20}, 15, 25),
    "string pattern": ({"type": "string", "pattern": "^[a-c]+$"}, "abc", "abd"),
    "string format date": ({"type": "string", "format": "date"}, "2024-01-31", "2024-13-01"),
    "additionalProperties false": (
        {**_OBJ, "properties": {"a": {"type": "integer"}}},
        {"a": 1},
        {"a": 1, "b": 2},
    ),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
}


@dataclass
class EngineReport:
    """One engine on one tokenizer: what it costs and what it covers (None where it failed)."""

    name: str
    version: str
    licence: str
    tokenizer_seconds: float | None = None
    build_seconds: dict[str, float | None] = field(default_factory=dict)
    mask_seconds: dict[tuple[str, int], float | None] = field(default_factory=dict)
    coverage: dict[str, str] = field(default_factory=dict)
    error: str = ""


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _unpack(bits: np.ndarray, vocab_size: int) -> torch.Tensor:
    """``[N, W]`` int32 bitmasks -> ``[N, V]`` bool."""
    return torch.from_numpy(
        np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].view(np.bool_)
    )


class _LLGuidance:
    """This package's constraints on llguidance."""

    name, dist = "llguidance", "llguidance"

    def prepare(self, tokenizer, eos: list[int]) -> None:
        self.tokenizer, self.eos = tokenizer, eos
        engine_tokenizer(tokenizer, tuple(sorted(set(eos))))

    def compile(self, kind: str, spec):
        make = RegexConstraint if kind == "regex" else JsonSchemaConstraint
        return make(spec, self.tokenizer, self.eos)

    def matcher(self, compiled):
        return compiled._root.deep_copy()

    def advance(self, m, tokens: list[int]) -> bool:
        return m.consume_tokens(tokens)

    def accepting(self, m) -> bool:
        return m.is_accepting()

    def fill(self, matchers: list, bits: np.ndarray) -> None:
        fill_bitmasks([(m, i) for i, m in enumerate(matchers)], bits)


class _OutlinesCore:
    """outlines-core: a regex (a JSON schema turned into one) indexed over the vocabulary."""

    name, dist = "outlines-core", "outlines_core"

    def prepare(self, tokenizer, eos: list[int]) -> None:
        from outlines_core import Vocabulary

        vocab, _ = token_bytes(tokenizer)
        tokens: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if b is not None and i not in eos:
                tokens.setdefault(b, []).append(i)
        self.vocabulary = Vocabulary(eos[0], tokens)

    def compile(self, kind: str, spec):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        pattern = spec if kind == "regex" else build_regex_from_schema(json.dumps(spec))
        return Index(pattern, self.vocabulary)

    def matcher(self, compiled):
        from outlines_core import Guide

        return Guide(compiled)

    def advance(self, m, tokens: list[int]) -> bool:
        try:
            for t in tokens:
                m.advance(t, return_tokens=False)
        except Exception:  # it raises on a token the index refuses
            return False
        return True

    def accepting(self, m) -> bool:
        return m.is_finished()

    def fill(self, matchers: list, bits: np.ndarray) -> None:
        for row, m in zip(bits, matchers):
            m.write_mask_into(row.ctypes.data, row.size, 4)


class _XGrammar:
    """xgrammar: a grammar compiled against the tokenizer, batched masks."""

    name, dist = "xgrammar", "xgrammar"

    def prepare(self, tokenizer, eos: list[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, kind: str, spec):
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_json_schema(
            json.dumps(spec), any_whitespace=False, separators=(", ", ": ")
        )

    def matcher(self, compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def advance(self, m, tokens: list[int]) -> bool:
        return all(m.accept_token(t) for t in tokens)

    def accepting(self, m) -> bool:
        return m.is_completed()

    def fill(self, matchers: list, bits: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bits))


ENGINES = {e.name: e for e in (_LLGuidance, _OutlinesCore, _XGrammar)}


def _build(engine, kind: str, spec, vocab_size: int) -> None:
    """Compile, then compute the first mask: what generating needs before its first token."""
    bits = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
    engine.fill([engine.matcher(engine.compile(kind, spec))], bits)


def _accepts(engine, compiled, ids: list[int]) -> bool:
    m = engine.matcher(compiled)
    return engine.advance(m, ids) and engine.accepting(m)


def _coverage(engine, tokenizer) -> dict[str, str]:
    """Per feature: ``yes``, ``refused`` (an error), ``ignored`` (both instances pass), ``wrong``.

    ``yes``: the valid instance passes and the invalid one does not; ``wrong``: the valid one fails.
    """
    out = {}
    for feature, (schema, good, bad) in FEATURES.items():
        try:
            compiled = engine.compile("json", schema)
        except Exception:  # each engine has its own error types
            out[feature] = "refused"
            continue
        ok = [
            _accepts(engine, compiled, tokenizer.encode(json.dumps(x), add_special_tokens=False))
            for x in (good, bad)
        ]
        out[feature] = {(True, False): "yes", (True, True): "ignored"}.get(tuple(ok), "wrong")
    return out


def _masks(engine, compiled, ids: list[int], n: int, vocab_size: int, repeats: int) -> float:
    """Median seconds to fill and unpack the masks of n fresh matchers spread along ``ids``.

    Fresh matchers each time (made and advanced untimed): engines cache the mask of a state,
    and a decoding step meets new states.
    """
    bits = np.zeros((n, (vocab_size + 31) // 32), dtype=np.int32)
    times = []
    for _ in range(repeats):
        matchers = [engine.matcher(compiled) for _ in range(n)]
        for i, m in enumerate(matchers):
            if not engine.advance(m, ids[: i % len(ids)]):
                raise ValueError(f"{engine.name} refuses a prefix of its own valid output")
        start = time.perf_counter()
        engine.fill(matchers, bits)
        _unpack(bits, vocab_size)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_engine(
    name: str, tokenizer, eos: list[int], *, repeats: int = 5, batch_sizes=(8, 64)
) -> EngineReport:
    """Build times, mask times per batch and coverage of one engine (``error``: it is missing).

    Build times are medians of ``repeats``, the first mask included and the tokenizer's
    conversion (once per tokenizer) apart.
    """
    engine = ENGINES[name]()
    try:
        dist = importlib.metadata.distribution(engine.dist)
    except importlib.metadata.PackageNotFoundError:
        return EngineReport(name, "", "", error="not installed")
    licence = dist.metadata.get("License-Expression") or dist.metadata.get("License") or ""
    report = EngineReport(name, dist.version, licence)
    vocab_size = len(tokenizer)
    start = time.perf_counter()
    engine.prepare(tokenizer, eos)  # imports the engine too: imports are not build time
    report.tokenizer_seconds = time.perf_counter() - start
    for task, (kind, spec, text) in TASKS.items():
        try:
            build = partial(_build, engine, kind, spec, vocab_size)
            report.build_seconds[task] = _median_seconds(build, repeats)
            compiled, ids = engine.compile(kind, spec), tokenizer.encode(text, add_special_tokens=False)
            for n in batch_sizes:
                report.mask_seconds[(task, n)] = _masks(engine, compiled, ids, n, vocab_size, 4 * repeats)
        except Exception:  # an engine that cannot build or mask a task: None in the table
            report.build_seconds.setdefault(task, None)
    report.coverage = _coverage(engine, tokenizer)
    return report
