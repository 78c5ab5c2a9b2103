"""A pair's batched backends: both models on the HF backend, or both on vLLM engines."""

from __future__ import annotations

import functools
import pathlib

import torch

from ..backends.hf import HFBatchedLM
from ..backends.llama import LlamaForward, unsupported
from ..backends.packages import CompiledParts
from ..config import FORWARDS
from .checkpoint import engine_parts
from .loading import LoadedModel, cache_root


def batched_pair(
    target: LoadedModel,
    draft: LoadedModel,
    *,
    backend: str,
    max_cache_bytes: int,
    vllm_options: dict | None,
    forward: str = "auto",
) -> tuple:
    """The target's and the draft's ``BatchedLM`` on ``backend`` (``"hf"`` or ``"vllm"``).

    ``forward``: how the HF backend computes a forward (``config.FORWARDS``; ``forward_of``).
    """
    if backend == "vllm":
        if forward == "compiled":
            raise ValueError("--forward compiled runs on the hf backend; vLLM compiles its own forwards")
        options = dict(vllm_options or {})
        return _vllm_lm(target, "target", options), _vllm_lm(draft, "draft", options)
    if target.model is None or draft.model is None:
        raise ValueError(
            f"the {backend} backend runs models built in PyTorch; these were loaded for vLLM only "
            "(SMCSD.load(..., backend='vllm'))"
        )
    return tuple(
        HFBatchedLM(
            m.model, max_cache_bytes=max_cache_bytes, name=role, compiled=forward_of(m.model, forward, role)
        )
        for m, role in ((target, "target"), (draft, "draft"))
    )


def forward_of(model: torch.nn.Module, choice: str, role: str = "model") -> LlamaForward | None:
    """Our forward of ``model`` under ``choice`` (one of ``FORWARDS``), or None for the model's own.

    ``compiled`` compiles the parts not yet built (once per machine: they are kept on disk) and
    refuses, in one line, a model our forward cannot run; ``auto`` loads the parts already built
    and runs the model's own forward where ours cannot.
    """
    if choice not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, got {choice!r}")
    if choice == "reference":
        return None
    reason = unsupported(model)
    if reason is not None:
        if choice == "compiled":
            raise ValueError(f"the compiled forward cannot run the {role}: {reason} (use --forward auto)")
        return None
    ours = LlamaForward(model, shared_parts(cache_root() / "graphs"))
    device = next(model.parameters()).device
    if choice == "compiled":
        ours.parts.build(ours.shape, device)
    else:
        ours.parts.load(ours.shape, device)
    return ours


@functools.cache
def shared_parts(root: pathlib.Path) -> CompiledParts:
    """The process's compiled parts kept under ``root`` (one set for every model of a layer shape)."""
    return CompiledParts(root)


def _vllm_lm(model: LoadedModel, role: str, options: dict):
    """A model's vLLM backend: its head read from its checkpoint, or taken from the built model."""
    from ..backends.vllm import built_parts, vllm_backend

    parts = (
        engine_parts(model) if model.model is None else built_parts(model, role=role, cache_root=cache_root())
    )
    return vllm_backend(parts, role=role, options=options)
