"""A pair's batched backends: both models on the HF backend, or both on vLLM engines."""

from __future__ import annotations

import functools
import pathlib

import torch

from ..backends.fixed import Buckets, FixedShape, ShapedLM
from ..backends.graphs import CudaGraphs
from ..backends.hf import DEFAULT_CACHE_BUDGET, HFBatchedLM
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
    deterministic: bool = False,
) -> tuple:
    """The target's and the draft's ``BatchedLM`` on ``backend`` (``"hf"`` or ``"vllm"``).

    ``forward``: how the HF backend computes a forward (``config.FORWARDS``; ``forward_of``).
    ``deterministic``: every forward has the shapes a request's rows have alone
    (``backends.fixed``). On CUDA our forward runs at bucketed shapes, each replayed as a CUDA
    graph (``backends.graphs``).
    """
    if backend == "vllm":
        if forward == "compiled" or deterministic:
            what = "--forward compiled" if forward == "compiled" else "--deterministic"
            raise ValueError(f"{what} runs on the hf backend; vLLM runs its own forwards")
        options = dict(vllm_options or {})
        return _vllm_lm(target, "target", options), _vllm_lm(draft, "draft", options)
    if target.model is None or draft.model is None:
        raise ValueError(
            f"the {backend} backend runs models built in PyTorch; these were loaded for vLLM only "
            "(SMCSD.load(..., backend='vllm'))"
        )
    graphs = CudaGraphs()  # one memory pool for both models' graphs
    return tuple(
        backend_of(
            m.model,
            forward,
            role,
            deterministic=deterministic,
            graphs=graphs,
            max_cache_bytes=max_cache_bytes,
        )
        for m, role in ((target, "target"), (draft, "draft"))
    )


def backend_of(
    model: torch.nn.Module,
    forward: str,
    role: str = "model",
    *,
    deterministic: bool = False,
    graphs: CudaGraphs | None = None,
    max_cache_bytes: int = DEFAULT_CACHE_BUDGET,
) -> HFBatchedLM:
    """One model's HF backend under ``forward`` (``config.FORWARDS``).

    ``deterministic``: fixed shapes (``fixed.FixedShape``); on CUDA our forward runs at
    bucketed shapes, each replayed as a CUDA graph from ``graphs``.
    """
    options = dict(max_cache_bytes=max_cache_bytes, name=role)
    options["compiled"] = ours = forward_of(model, forward, role, few_rows=not deterministic)
    on_gpu = next(model.parameters()).device.type == "cuda" and ours is not None
    graphs = (graphs or CudaGraphs()) if on_gpu else None
    if deterministic:
        return ShapedLM(model, FixedShape(), graphs=graphs, **options)
    if on_gpu:  # launches are what a small forward costs there: replayed graphs
        return ShapedLM(model, Buckets(), graphs=graphs, **options)
    return HFBatchedLM(model, **options)


def forward_of(
    model: torch.nn.Module, choice: str, role: str = "model", *, few_rows: bool = True
) -> LlamaForward | None:
    """Our forward of ``model`` under ``choice`` (one of ``FORWARDS``), or None for the model's own.

    ``compiled`` compiles the parts not yet built (once per machine: they are kept on disk) and
    refuses, in one line, a model our forward cannot run; ``auto`` loads the parts already built
    and runs the model's own forward where ours cannot. ``few_rows``: ``cpu.CPUTricks.few_rows``.
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
    ours = LlamaForward(model, shared_parts(cache_root() / "graphs"), few_rows=few_rows)
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
