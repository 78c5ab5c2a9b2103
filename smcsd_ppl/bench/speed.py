"""Side-by-side speed measurement of SMC-SD and its baselines in one process."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..api import SMCSD
from ..config import DraftRecord, SMCConfig
from ..engine.worker import torch_thread
from ..methods import METHODS
from ..methods.hf import hf_generate

HF_GENERATE = "hf_generate"  # Hugging Face generate(): the external reference, not a registered method
SPEED_METHODS = (HF_GENERATE, "ar", "sd", "smcsd", "smcsd_paper")
"""The methods ``smcsd speed`` compares: the reference, then registered methods."""
VLLM_SPEED_METHODS = ("ar", "sd", "smcsd", "smcsd_paper")
BESIDE_METHODS = ("ar", "smcsd", "smcsd_paper")
"""What ``smcsd speed --forward`` also times on the chosen forward, beside the reference rows."""
"""What it compares on the vLLM backend (beside the HF backend's AR)."""


def speed_choices() -> tuple[str, ...]:
    """Every method a speed comparison can time: the reference and every registered method."""
    return (HF_GENERATE, *METHODS)


def timed_run(
    pair: SMCSD, method: str, prompt_ids: list[int], config: SMCConfig
) -> tuple[float, float, float]:
    """Tokens/s, tokens per target call and loop-overhead share of one run (nan where unknown)."""
    if method == HF_GENERATE:
        # On the torch thread, as every method runs: forwards from a second thread run on a second
        # OpenMP team, and a process with two ran the few-row product slower (docs/benchmarks.md).
        ids, secs = torch_thread().run(
            lambda: hf_generate(
                pair.target.model,
                prompt_ids,
                max_new_tokens=config.max_new_tokens,
                temperature=config.target_temperature,
                seed=config.seed,
                exact_length=True,
            )
        )
        return len(ids) / secs, 1.0, float("nan")
    (out,) = pair.generate_ids([prompt_ids], method=method, config=config)
    return out.stats.tokens_per_second, out.stats.tokens_per_target_call, out.stats.overhead_fraction


@dataclass
class SpeedRow:
    """Medians over prompts x repeats of one method."""

    method: str
    tokens_per_second: float
    speedup_vs_ar: float
    tokens_per_target_call: float
    overhead_fraction: float
    runs: int


def learn_draft(pair: SMCSD, prompt: str, config: SMCConfig) -> None:
    """Give a pair with no draft record one learned from ``prompt`` (``SMCSD.calibrate``).

    A draft that ships a record is measured from it, as users run it; a pair without one
    learns once first, so that the timed requests measure drafting, not one probe each.
    """
    if pair.draft_record == DraftRecord():
        pair.calibrate(prompt, config)


def compare_speed(
    pair: SMCSD,
    prompts: Sequence[str],
    config: SMCConfig,
    *,
    repeats: int = 3,
    methods: Sequence[str] = SPEED_METHODS,
    on_run: Callable[[str], None] | None = None,
    others: dict[str, tuple[SMCSD, str]] | None = None,
) -> list[SpeedRow]:
    """Run every method on every prompt ``repeats`` times, interleaved, and take medians.

    ``others`` adds rows run on other pairs (label -> pair, method), interleaved the same way:
    the HF backend's AR beside a vLLM pair's methods, say.

    Every run emits exactly ``config.max_new_tokens`` tokens (EOS ignored), so
    tokens/s compare like with like; interleaving spreads machine noise evenly. SMC-SD's
    timed runs start from the pair's draft record (``learn_draft``).
    """
    unknown = set(methods) - set(speed_choices())
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {speed_choices()}")
    config = dataclasses.replace(config, ignore_eos=True)
    runs_of = {m: (pair, m) for m in methods} | dict(others or {})
    samples: dict[str, list[tuple[float, float, float]]] = {m: [] for m in runs_of}
    warm = dataclasses.replace(config, max_new_tokens=8)
    learn_draft(pair, prompts[0], warm)
    pair.generate(prompts[0], method="smcsd", config=warm)  # first calls pay for lazy set-up
    for runner, method in (others or {}).values():  # other pairs' first calls, untimed too
        runner.generate(prompts[0], method=method, config=config)
    for rep in range(repeats):
        for prompt in prompts:
            for label, (runner, method) in runs_of.items():
                cfg = dataclasses.replace(config, seed=config.seed + rep)
                samples[label].append(timed_run(runner, method, runner.encode(prompt), cfg))
                if on_run is not None:
                    on_run(label)
    ar = statistics.median(t for t, _, _ in samples["ar"]) if "ar" in samples else float("nan")
    rows = []
    for method, runs in samples.items():
        tps = statistics.median(t for t, _, _ in runs)
        rows.append(
            SpeedRow(
                method,
                tps,
                tps / ar,
                statistics.median(c for _, c, _ in runs),
                statistics.median(o for _, _, o in runs),
                len(runs),
            )
        )
    return rows
