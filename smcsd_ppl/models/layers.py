"""Drafts made of a target's own decoder layers: find them and assemble a smaller model."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import transformers
from torch import nn


def decoder_layers(full: transformers.PreTrainedModel) -> nn.ModuleList:
    """The decoder layers of a Llama-like model, or a ``ValueError``."""
    layers = getattr(getattr(full, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"drafts built from target layers need a model with `.model.layers` (Llama-like); "
            f"{type(full).__name__} has none"
        )
    return layers


def layer_config(
    config: transformers.PretrainedConfig, indices: Sequence[int]
) -> transformers.PretrainedConfig:
    """A copy of ``config`` for a model of the decoder layers ``indices`` (in that order)."""
    config = copy.deepcopy(config)
    # Per-layer lists (e.g. `layer_types`) must match the new depth or config validation fails.
    for key, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == config.num_hidden_layers:
            setattr(config, key, type(value)(value[i] for i in indices))
    config.num_hidden_layers = len(indices)
    return config


def assemble(
    full: transformers.PreTrainedModel, indices: Sequence[int], layers: nn.ModuleList, norm: nn.Module | None
) -> transformers.PreTrainedModel:
    """A model of ``full``'s class with the given decoder layers; everything else is shared."""
    config = layer_config(full.config, indices)
    # Meta device: build only the skeleton; every tensor is replaced below.
    with torch.device("meta"):
        draft = type(full)(config)
    for name, child in full.named_children():
        if name != "model":
            setattr(draft, name, child)
    own = {"layers": layers} | ({"norm": norm} if norm is not None else {})
    for name, child in (dict(full.model.named_children()) | own).items():
        setattr(draft.model, name, child)
    leftover = [n for n, t in (*draft.named_parameters(), *draft.named_buffers()) if t.is_meta]
    if leftover:
        raise ValueError(f"cannot build a draft of {type(full).__name__}: unshared tensors {leftover[:3]}")
    draft.generation_config = copy.deepcopy(full.generation_config)
    return draft


def trainable_copy(
    full: transformers.PreTrainedModel, source_layers: Sequence[int]
) -> transformers.PreTrainedModel:
    """``full`` with fp32, trainable copies of its ``source_layers`` and final norm; the rest shared.

    Embeddings, rotary embedding and LM head stay the target's (and frozen with it).
    """
    layers = decoder_layers(full)
    indices = [int(i) for i in source_layers]
    if not indices or len(set(indices)) != len(indices) or not all(0 <= i < len(layers) for i in indices):
        raise ValueError(f"source layers must be distinct indices in [0, {len(layers) - 1}], got {indices}")
    own = nn.ModuleList(copy.deepcopy(layers[i]).float() for i in indices)
    for j, layer in enumerate(own):  # the draft's KV cache is indexed by layer_idx
        if hasattr(getattr(layer, "self_attn", None), "layer_idx"):
            layer.self_attn.layer_idx = j
    norm = copy.deepcopy(full.model.norm).float()
    draft = assemble(full, indices, own, norm)
    for module in (own, norm):
        module.requires_grad_(True)
    return draft
