"""SMC speculative decoding as a probabilistic-programming extension of LLaMPPL.

The public names load on first use (PEP 562), so that ``import smcsd_ppl`` and
``smcsd --help`` do not pay for torch, transformers and llamppl.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the submodule that defines it; everything else is internal
_EXPORTS = {
    "SMCSD": "api",
    "SMCConfig": "config",
    "DraftRecord": "config",
    "SMCSDModel": "inference.program",
    "Generation": "results",
    "SMCInfo": "results",
    "SpeculativeInfo": "results",
    "RunStats": "results",
    "Constraint": "potentials.constraints",
    "RegexConstraint": "potentials.grammar",
    "JsonSchemaConstraint": "potentials.grammar",
    "PotentialConstraint": "potentials.constraints",
}

__all__ = [  # noqa: RUF022 (the order of _EXPORTS)
    "SMCSD",
    "SMCConfig",
    "DraftRecord",
    "SMCSDModel",
    "Generation",
    "SMCInfo",
    "SpeculativeInfo",
    "RunStats",
    "Constraint",
    "RegexConstraint",
    "JsonSchemaConstraint",
    "PotentialConstraint",
]

if TYPE_CHECKING:
    from .api import SMCSD
    from .config import DraftRecord, SMCConfig
    from .inference.program import SMCSDModel
    from .potentials.constraints import Constraint, PotentialConstraint
    from .potentials.grammar import JsonSchemaConstraint, RegexConstraint
    from .results import Generation, RunStats, SMCInfo, SpeculativeInfo


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
