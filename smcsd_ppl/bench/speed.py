"""Side-by-side speed measurement of SMC-SD and its baselines in one process."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..api import SMCSD
from ..config import SMCConfig
from ..methods.hf import hf_generate

SPEED_METHODS = ("hf_generate", "ar", "sd", "smcsd", "smcsd_paper")


@dataclass
class SpeedRow:
    """Medians over prompts x repeats of one method."""

    method: str
    tokens_per_second: float
    speedup_vs_ar: float
    tokens_per_target_call: float
    overhead_fraction: float
    runs: int


def compare_speed(
    pair: SMCSD,
    prompts: Sequence[str],
    config: SMCConfig,
    *,
    repeats: int = 3,
    methods: Sequence[str] = SPEED_METHODS,
    on_run: Callable[[str], None] | None = None,
) -> list[SpeedRow]:
    """Run every method on every prompt ``repeats`` times, interleaved, and take medians.

    Every run emits exactly ``config.max_new_tokens`` tokens (EOS ignored), so
    tokens/s compare like with like; interleaving spreads machine noise evenly.
    """
    unknown = set(methods) - set(SPEED_METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {SPEED_METHODS}")
    config = dataclasses.replace(config, ignore_eos=True)
    samples: dict[str, list[tuple[float, float, float]]] = {m: [] for m in methods}
    pair.generate(prompts[0], method="smcsd", config=dataclasses.replace(config, max_new_tokens=8))  # warm-up
    for rep in range(repeats):
        for prompt in prompts:
            for method in methods:
                cfg = dataclasses.replace(config, seed=config.seed + rep)
                if method == "hf_generate":
                    ids, secs = hf_generate(
                        pair.target.model,
                        pair.encode(prompt),
                        max_new_tokens=cfg.max_new_tokens,
                        temperature=cfg.target_temperature,
                        seed=cfg.seed,
                        exact_length=True,
                    )
                    samples[method].append((len(ids) / secs, 1.0, float("nan")))
                else:
                    s = pair.generate(prompt, method=method, config=cfg).stats
                    samples[method].append(
                        (s.tokens_per_second, s.tokens_per_target_call, s.overhead_fraction)
                    )
                if on_run is not None:
                    on_run(method)
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
