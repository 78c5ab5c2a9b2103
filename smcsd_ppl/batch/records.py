"""Output records of a JSONL file: read, resumed, appended, and checked against the run's settings.

What ``smcsd batch`` (and the benchmark grid on top of it) writes: one JSON line per finished
prompt, on disk as soon as it is written, so an interrupted run resumes where it stopped, and
only under the settings and prompts it was made with.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import SMCConfig
from ..keys import derive
from .prompt import Prompt

if TYPE_CHECKING:
    from ..api import SMCSD


def record_seed(key: Sequence, base_seed: int = 0) -> int:
    """A seed that depends on the record's key only, never on the order records are run in."""
    return derive(base_seed, "record", json.dumps(list(key))) & 0x7FFFFFFF


def read_records(path: str | Path, key_fields: Sequence[str], writer: str) -> tuple[list[dict], int]:
    """Records of a JSONL file and the byte length of its complete part, read line by line.

    A last line cut short (a run killed mid-write) is ignored; a bad line elsewhere, or a line
    without the ``key_fields`` of the records ``writer`` writes, is an error.
    """
    path = Path(path)
    if not path.exists():
        return [], 0
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    records, good, pos, bad = [], 0, 0, None
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            pos += len(line)
            if not line.strip():
                continue
            if bad is not None:
                raise ValueError(f"{path}: line {bad[0]} is not valid JSON ({bad[1]})")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                bad = (n, err.msg)  # the truncated tail, unless a line follows
                continue
            missing = [f for f in key_fields if f not in record] if isinstance(record, dict) else key_fields
            if missing:
                raise ValueError(
                    f"{path}: line {n} is not a record of {writer} (no {missing[0]!r} field); "
                    f"give the file that {writer} wrote"
                )
            records.append(record)
            good = pos
    return records, good


def prompt_digest(prompt: Prompt) -> str:
    """A short hash of a prompt's content (text and reference answer), stored in its records."""
    return hashlib.sha256(json.dumps([prompt.text, prompt.answer]).encode()).hexdigest()[:16]


def run_settings(pair: SMCSD, base: SMCConfig) -> dict:
    """Every setting of a run that changes its records, beyond a record's own key."""
    return {
        "target": pair.target.name,
        "draft": pair.draft.name,
        "chat": pair.chat,
        "max_new_tokens": base.max_new_tokens,
        "base_seed": base.seed,
        "ess_threshold": base.ess_threshold,
        "resampling": base.resampling,
        "alpha": base.alpha,
        "selection": base.selection,
        "ignore_eos": base.ignore_eos,
        "cut": base.cut,  # smcsd_paper rows run without it whatever it is
        "cut_divergence": base.cut_divergence,
        "device": str(pair.target_lm.device),
        "dtype": str(pair.target_lm.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }


def existing_records(out_path: Path, **kwargs) -> tuple[list[dict], int]:
    """The records already in ``out_path`` and the bytes of its complete lines (none: ``[], 0``).

    ``kwargs`` go to ``read_records`` (the key fields and writer of another kind of record).
    """
    if out_path.exists() and not out_path.is_file():  # a device or pipe cannot be resumed from
        raise ValueError(f"{out_path}: not a regular file; give the path of a JSONL file")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    return read_records(out_path, **kwargs)


@contextmanager
def appending(out_path: Path, good: int):
    """``out_path`` opened at its end, after its first ``good`` bytes (complete records)."""
    out_path.touch()
    with out_path.open("r+b") as f:
        f.truncate(good)  # drop a line cut short by a kill
        if good:
            f.seek(good - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.seek(0, os.SEEK_END)
        yield f


def append_record(f, record: dict) -> None:
    """Write one JSON line and make sure it is on disk."""
    f.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
    f.flush()
    os.fsync(f.fileno())  # a record on disk survives a kill right after it


def check_compatible(existing: list[dict], settings: dict, prompts: Sequence[Prompt]) -> None:
    """Refuse to resume from records made with other settings or other prompt texts."""
    check_settings(existing, settings)
    check_prompt_texts(existing, prompts)


def check_settings(existing: list[dict], settings: dict) -> None:
    """Refuse to resume from records made with other settings."""
    for r in existing:
        for name, value in settings.items():
            if r.get(name) != value:
                raise ValueError(
                    f"the output file holds records made with {name}={r.get(name)!r}, this run has "
                    f"{value!r}; records are resumed only under the same settings: use another --out file"
                )


def check_prompt_texts(existing: list[dict], prompts: Sequence[Prompt]) -> None:
    """Refuse to resume from records of prompts whose text or answer has changed since."""
    digests = {p.id: prompt_digest(p) for p in prompts}
    for r in existing:
        if r["prompt_id"] in digests and r.get("prompt_sha") != digests[r["prompt_id"]]:
            raise ValueError(
                f"prompt {r['prompt_id']!r} has another text or answer than in the output file's records "
                "(the dataset changed); use another --out file"
            )
