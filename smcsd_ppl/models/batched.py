"""A pair's batched backends: both models on the HF backend, or both on vLLM engines."""

from __future__ import annotations

from ..backends.hf import HFBatchedLM
from .checkpoint import engine_parts
from .loading import LoadedModel, cache_root


def batched_pair(
    target: LoadedModel, draft: LoadedModel, *, backend: str, max_cache_bytes: int, vllm_options: dict | None
) -> tuple:
    """The target's and the draft's ``BatchedLM`` on ``backend`` (``"hf"`` or ``"vllm"``)."""
    if backend == "vllm":
        options = dict(vllm_options or {})
        return _vllm_lm(target, "target", options), _vllm_lm(draft, "draft", options)
    if target.model is None or draft.model is None:
        raise ValueError(
            f"the {backend} backend runs models built in PyTorch; these were loaded for vLLM only "
            "(SMCSD.load(..., backend='vllm'))"
        )
    return (
        HFBatchedLM(target.model, max_cache_bytes=max_cache_bytes, name="target"),
        HFBatchedLM(draft.model, max_cache_bytes=max_cache_bytes, name="draft"),
    )


def _vllm_lm(model: LoadedModel, role: str, options: dict):
    """A model's vLLM backend: its head read from its checkpoint, or taken from the built model."""
    from ..backends.vllm import built_parts, vllm_backend

    parts = (
        engine_parts(model) if model.model is None else built_parts(model, role=role, cache_root=cache_root())
    )
    return vllm_backend(parts, role=role, options=options)
