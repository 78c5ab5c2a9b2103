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
``STEERING_METHODS`` names every runner, as the method registry names the generation methods.
"""

from functools import partial

from .base import SteeringRecord, SteeringRunner, TaskConstraint
from .smcsd import EveryParticle, smcsd_constrained, smcsd_filtered, smcsd_plain
from .token_level import GENLM_SAMPLERS, TokenLMs, TokenRun, genlm_smc, llamppl_smc, seeded

STEERING_METHODS: dict[str, SteeringRunner] = {
    "smcsd_proposal": partial(smcsd_constrained, mode="proposal"),
    "smcsd_critic": partial(smcsd_constrained, mode="critic"),
    "smcsd_filtered": smcsd_filtered,
    "smcsd_plain": smcsd_plain,
    "llamppl_smc": llamppl_smc,
    "llamppl_masked": partial(llamppl_smc, masked=True),
    "genlm_awrs": partial(genlm_smc, sampler="awrs"),
    "genlm_direct": partial(genlm_smc, sampler="direct"),
    "genlm_critic": partial(genlm_smc, sampler="critic"),
}
"""Every constrained-generation method by name: ``(ctx, prompt, constraint, **kw) -> SteeringRecord``."""

SMCSD_STEERING = tuple(name for name in STEERING_METHODS if name.startswith("smcsd_"))
"""The SMC-SD ones (they take a block size K and a quality cut)."""
TOKEN_STEERING = tuple(name for name in STEERING_METHODS if name not in SMCSD_STEERING)
"""The token-level libraries' (they take a ``TokenLMs`` as ``lms``)."""

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
    "TokenRun",
    "genlm_smc",
    "llamppl_smc",
    "seeded",
    "smcsd_constrained",
    "smcsd_filtered",
    "smcsd_plain",
]
