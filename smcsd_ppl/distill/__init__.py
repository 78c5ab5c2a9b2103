"""Distilling a draft model for a target: data, training, evaluation."""

from .data import CollectSettings, Example, collect, continue_prompts, corpus_examples, load_examples
from .evaluate import forward_cost, match_metrics, smc_metrics
from .losses import Objective
from .prompts import builtin_prompts
from .train import DistillConfig, Progress, distill

__all__ = [
    "DistillConfig",
    "Example",
    "Objective",
    "Progress",
    "builtin_prompts",
    "CollectSettings",
    "collect",
    "continue_prompts",
    "corpus_examples",
    "distill",
    "forward_cost",
    "load_examples",
    "match_metrics",
    "smc_metrics",
]
