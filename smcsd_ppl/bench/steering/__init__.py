"""Constrained-generation baselines: LLaMPPL and genlm-control SMC next to SMC-SD.

Every runner takes the same inputs (a ``RunContext`` of the pair, a text prompt, a
constraint, N, a token budget, one temperature T for every model, a seed) and returns a
``SteeringRecord``; ``SMCSD.context()`` builds the context:

* ``llamppl_smc``: a ``llamppl.Model`` sampling token by token from the target
  (``CachedCausalLM`` over genlm-backend's ``AsyncTransformer`` built from the in-memory
  model), the constraint as ``self.condition`` on each prefix; ``masked=True`` instead
  observes the allowed-token mask first (LLaMPPL's ``mask_dist`` idiom), a token-level
  proposal restricted to allowed tokens. Run with ``smc_standard``.
* ``genlm_smc``: genlm-control's ``SMC`` with ``AWRS(llm, constraint)``,
  ``direct_token_sampler(llm * constraint)``, or the critic variant
  ``SMC(direct_token_sampler(llm), critic=constraint)``.
* ``smcsd_filtered``: SMC-SD without the constraint, then rejection of invalid particles.
* ``smcsd_constrained`` (mode ``proposal`` / ``critic``) and ``smcsd_plain``: SMC-SD programs.

The token-level libraries read the target through one ``AsyncTransformer`` per pair, kept by
the caller's ``TokenLMs``; its caches are cleared before every run, its auto-batch size is set
to N (a batch leaves as soon as every particle has asked) and only the prompt's KV is cached,
as those libraries do. ``seconds`` covers the SMC call, prompt prefill included; building
vocabularies, coercions and compiled constraints once per pair or constraint is not timed.
Importing this package registers every runner in ``STEERING_METHODS``.
"""

from . import smcsd, token_level  # noqa: F401 (they register, in this order)
from .base import STEERING_METHODS, SteeringRecord, SteeringRunner, TaskConstraint, get, register
from .smcsd import EveryParticle, smcsd_constrained, smcsd_filtered, smcsd_plain
from .token_level import GENLM_SAMPLERS, TokenLMs, genlm_smc, llamppl_smc, seeded

SMCSD_STEERING = tuple(name for name in STEERING_METHODS if name.startswith("smcsd_"))
"""The SMC-SD ones (they take a block size K and a quality cut)."""
TOKEN_STEERING = tuple(name for name in STEERING_METHODS if name not in SMCSD_STEERING)
"""The token-level libraries' (they take a ``TokenLMs``)."""

__all__ = [
    "GENLM_SAMPLERS",
    "SMCSD_STEERING",
    "STEERING_METHODS",
    "TOKEN_STEERING",
    "EveryParticle",
    "SteeringRecord",
    "SteeringRunner",
    "TaskConstraint",
    "TokenLMs",
    "genlm_smc",
    "get",
    "llamppl_smc",
    "register",
    "seeded",
    "smcsd_constrained",
    "smcsd_filtered",
    "smcsd_plain",
]
