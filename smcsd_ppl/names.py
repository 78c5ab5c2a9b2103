"""The names of what the command line runs, in a module that imports nothing heavy.

Building the parser imports only this (and the settings), never torch. The method registry
takes each method's summary from here; the benchmark registries are checked against these
lists by the tests.
"""

from __future__ import annotations

METHOD_SUMMARIES = {
    "smcsd": "SMC speculative decoding (N particles x K-token blocks)",
    "smcsd_paper": "the paper's SMC-SD: whole K-token blocks, fixed N and K (no cut)",
    "sd": "exact speculative sampling (Leviathan et al.)",
    "ar": "autoregressive sampling from the target",
    "easd": "speculative sampling with EASD's entropy-aware rejection (not exact)",
    "hf_assisted": "Hugging Face assisted generation (exact SD, batch 1, draft at T_t)",
    "hf_prompt_lookup": "Hugging Face prompt lookup decoding (batch 1)",
    "minedraft": "MineDraft-style SD: verify one half-batch while drafting the other",
    "racer": "RACER: retrieval + logit-cue draft trees, greedy (target argmax)",
    "racer_sampling": "RACER draft trees with exact sampling at T_t",
}
"""The generation methods (``smcsd_ppl.methods.METHODS``), each with its one-line summary."""

INTERLEAVED_METHODS = ("smcsd", "ar", "sd", "hf_prompt_lookup", "racer_sampling")
"""The methods ``smcsd interleaved`` runs by default, call by call (``bench.interleaved``)."""

STEERING_METHODS = (
    "smcsd_proposal",
    "smcsd_critic",
    "smcsd_filtered",
    "smcsd_plain",
    "llamppl_smc",
    "llamppl_masked",
    "genlm_awrs",
    "genlm_direct",
    "genlm_critic",
)
"""The constrained-generation runners ``compare-constrained`` compares (``bench.steering``)."""

ENGINE_NAMES = ("llguidance", "outlines-core", "xgrammar")
"""The grammar engines ``constraint-engines`` compares (``bench.engines.ENGINES``)."""

JSON_METHODS = ("smcsd", "smcsd_paper", "ar_masked", "genlm_awrs")
"""The methods ``compare-json`` compares (``bench.json_tasks.METHODS``)."""

JSON_TASKS = ("flat", "nested")
"""The extraction tasks of ``compare-json`` (``bench.json_tasks.TASKS``)."""
