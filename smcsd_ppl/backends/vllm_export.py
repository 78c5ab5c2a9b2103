"""Weights a vLLM engine can load: a model that exists only in memory, written once to a cache."""

from __future__ import annotations

import hashlib
import pathlib
import shutil
import tempfile

import torch


def weights_dir(model, cache_root: pathlib.Path) -> str:
    """Where vLLM can load ``model`` (a ``LoadedModel``) from.

    A model loaded from a directory or hub id is loaded from there. A layer slice or a
    distilled draft exists only in memory: it is written once (weights and tokenizer) under
    ``cache_root/vllm``, keyed by a digest of its weights.
    """
    if model.path is not None:
        return model.path
    digest = hashlib.sha256(model.source.encode())
    for p in model.model.parameters():
        digest.update(f"{p.shape}{p.dtype}{float(p.sum(dtype=torch.float32)):.6e}".encode())  # no fp32 copy
    return write_once(
        cache_root / "vllm" / digest.hexdigest()[:16],
        lambda tmp: (model.model.save_pretrained(tmp), model.tokenizer.save_pretrained(tmp)),
    )


def write_once(final: pathlib.Path, write) -> str:
    """``final``, a model directory made by ``write(tmp)`` unless it is there already.

    Written in a temporary directory beside it, then renamed: a reader never sees half a model,
    and of two processes writing at once, one wins and the other keeps its result.
    """
    if (final / "config.json").is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        write(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "config.json").is_file():  # another process wrote it first otherwise
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
