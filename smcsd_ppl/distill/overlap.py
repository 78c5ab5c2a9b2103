"""Which prompts a distilled draft was trained on, so that evaluations can stay held out.

A draft's manifest lists short hashes of its training prompts (``training_prompts``);
``smcsd eval-draft`` warns when the prompts it measures on are among them, since a
draft agrees with its target far more often on prompts it was trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from collections.abc import Iterable

from ..models.drafts import MANIFEST


def prompt_hash(text: str) -> str:
    """A short hash of one prompt's text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def record_training_prompts(draft_dir: str | os.PathLike, texts: Iterable[str]) -> None:
    """Add the hashes of ``texts`` to the manifest of the draft in ``draft_dir`` (atomically)."""
    path = pathlib.Path(draft_dir) / MANIFEST
    manifest = json.loads(path.read_text())
    known = set(manifest.get("training_prompts", ()))  # a draft it started from, say
    manifest["training_prompts"] = sorted(known | {prompt_hash(t) for t in texts})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(path)


def training_overlap(draft_dir: str | os.PathLike, texts: Iterable[str]) -> int | None:
    """How many of ``texts`` the draft was trained on; ``None`` when its manifest does not say."""
    try:
        manifest = json.loads((pathlib.Path(draft_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    trained = manifest.get("training_prompts")
    if trained is None:
        return None
    trained = set(trained)
    return sum(prompt_hash(t) in trained for t in texts)
