"""Compare two lm-evaluation-harness runs of these tasks item by item (their --log_samples folders).

    python docs/lm-eval/compare.py RUN_A RUN_B

Prints, per task, how many generated answers are the same, the accuracies, and the largest
difference between the two runs' log-likelihoods of the same item; exits 1 where answers differ
or a log-likelihood moves by more than 1e-3.
"""

import json
import sys
from pathlib import Path


def samples(folder: str, task: str) -> list[dict]:
    [path] = Path(folder).rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def compare(a: str, b: str) -> bool:
    same = True
    generated = list(zip(samples(a, "smcsd_arithmetic"), samples(b, "smcsd_arithmetic")))
    equal = sum(x["filtered_resps"] == y["filtered_resps"] for x, y in generated)
    print(f"smcsd_arithmetic: {equal}/{len(generated)} answers the same")
    same &= equal == len(generated)
    for task, metric in (("smcsd_choices", "acc"), ("smcsd_continuations", "acc")):
        pairs = list(zip(samples(a, task), samples(b, task)))
        # Each item's (log-likelihood, is greedy) per choice (one for a continuation).
        gap = max(abs(float(u[0]) - float(v[0])) for x, y in pairs for u, v in zip(x["filtered_resps"], y["filtered_resps"]))
        accuracy = [sum(s[metric] for s in run) / len(run) for run in zip(*pairs)]
        print(f"{task}: {metric} {accuracy[0]:.3f} vs {accuracy[1]:.3f}, largest log-likelihood gap {gap:.2e}")
        same &= accuracy[0] == accuracy[1] and gap <= 1e-3
    return same


if __name__ == "__main__":
    sys.exit(0 if compare(sys.argv[1], sys.argv[2]) else 1)
