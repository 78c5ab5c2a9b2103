"""Loading targets and drafts: the embedded default, hub ids, layer and feature drafts."""

from .drafts import SHIPPED_DRAFT, load_draft, resolve_draft, slice_draft
from .loading import DEFAULT_TARGET, LoadedModel, embedded_default_dir, eos_ids, hub_reachable, load_model

__all__ = [
    "DEFAULT_TARGET",
    "SHIPPED_DRAFT",
    "LoadedModel",
    "embedded_default_dir",
    "eos_ids",
    "hub_reachable",
    "load_draft",
    "load_model",
    "resolve_draft",
    "slice_draft",
]
