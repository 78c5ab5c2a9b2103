"""Benchmarks: datasets, a resumable grid harness, quality metrics and reports."""

from ..batch.prompts import Prompt, load_prompts
from .harness import Grid, read_records, run_bench

__all__ = ["Prompt", "load_prompts", "Grid", "run_bench", "read_records"]
