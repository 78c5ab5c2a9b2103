"""Draft models for a target: layer slices that share its weights, and distilled drafts.

A distilled draft (made by ``smcsd distill``) is trained to match the target and is one of
two kinds: ``layers``, a few decoder layers of the target's own architecture, or
``features``, the same that also read the target's hidden states
(``feature_draft.FeatureDraft``). Both share the target's tokenizer, embeddings, rotary
embedding and LM head, so a saved draft holds only its own tensors (``draft.safetensors``)
plus a manifest (``smcsd_draft.json``) naming the target it fits.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Sequence

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from ..config import DraftRecord
from .feature_draft import FeatureDraft, feature_student, own_modules
from .layers import assemble, decoder_layers, trainable_copy
from .loading import DEFAULT_TARGET, LoadedModel, load_model

logger = logging.getLogger(__name__)

DEFAULT_DRAFT_LAYERS = 2  # slice size for targets that have no distilled draft
MANIFEST = "smcsd_draft.json"
WEIGHTS = "draft.safetensors"
SHIPPED_DRAFT = pathlib.Path(__file__).parents[1] / "weights" / "smollm2-135m-instruct-draft"
_FINGERPRINT_KEYS = ("model_type", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads")


def slice_draft(target: LoadedModel, n_layers: int) -> LoadedModel:
    """Build a draft from the target's first ``n_layers`` decoder layers.

    The draft shares (does not copy) all of the target's tensors, so it costs no memory.

    Raises:
        ValueError: If ``n_layers`` is out of range or the model has no ``.model.layers``.

    """
    layers = decoder_layers(target.model)
    total = len(layers)
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers < total:
        raise ValueError(f"slice size must be an integer in [1, {total - 1}], got {n_layers!r}")
    # The KV cache is indexed by layer_idx; the first n layers are already 0..n-1.
    draft = assemble(target.model, range(n_layers), nn.ModuleList(layers[:n_layers]), None)
    draft.eval().requires_grad_(False)
    source = f"layer slice: first {n_layers} of {total} layers of {target.name}"
    return LoadedModel(draft, target.tokenizer, f"layers:{n_layers}", source, is_slice=True)


def student(target: LoadedModel, source_layers: Sequence[int]) -> transformers.PreTrainedModel:
    """A trainable draft: fp32 copies of the target's ``source_layers`` and final norm."""
    return trainable_copy(target.model, source_layers)


def draft_modules(draft: nn.Module) -> dict[str, nn.Module]:
    """The modules a distilled draft owns, by name; the rest is the target's."""
    if isinstance(draft, FeatureDraft):
        return own_modules(draft)
    return {"layers": draft.model.layers, "norm": draft.model.norm}


def fingerprint(model: transformers.PreTrainedModel) -> dict:
    """The target properties a distilled draft depends on."""
    return config_fingerprint(model.config)


def config_fingerprint(config: transformers.PretrainedConfig) -> dict:
    """``fingerprint`` of a model from its config alone."""
    return {key: getattr(config, key, None) for key in _FINGERPRINT_KEYS}


def read_manifest(directory: str | os.PathLike, fingerprint_now: dict, target_name: str) -> dict:
    """A distilled draft's manifest, checked against its target's fingerprint (a ValueError if not its)."""
    path = pathlib.Path(directory)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{str(path)!r} does not hold a readable distilled draft: {err}") from err
    if manifest.get("fingerprint") != fingerprint_now:
        raise ValueError(
            f"draft {str(path)!r} was distilled for {manifest.get('target')!r} "
            f"({manifest.get('fingerprint')}), not for {target_name!r} ({fingerprint_now})"
        )
    return manifest


def save_draft(draft: nn.Module, directory: str | os.PathLike, manifest: dict) -> None:
    """Write a distilled draft's own tensors (bf16) and its manifest, atomically.

    Args:
        draft: a model made by ``student`` or ``feature_student`` (its shared tensors are
            not written).
        directory: created if missing.
        manifest: must hold ``target``, ``fingerprint`` and ``source_layers``; more keys
            (training facts) are kept as they are. The draft's kind is added.
    """
    missing = {"target", "fingerprint", "source_layers"} - set(manifest)
    if missing:
        raise ValueError(f"draft manifest lacks {sorted(missing)}")
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{name}.{k}": v for name, m in draft_modules(draft).items() for k, v in m.state_dict().items()
    }
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in tensors.items()}
    save_file(tensors, out / f"{WEIGHTS}.tmp")
    (out / f"{MANIFEST}.tmp").write_text(
        json.dumps({"format": 1, "kind": _kind(draft), **manifest}, indent=2) + "\n"
    )
    os.replace(out / f"{WEIGHTS}.tmp", out / WEIGHTS)
    os.replace(out / f"{MANIFEST}.tmp", out / MANIFEST)


def _kind(draft: nn.Module) -> str:
    return "features" if isinstance(draft, FeatureDraft) else "layers"


def is_draft_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a distilled draft."""
    return (pathlib.Path(path) / MANIFEST).is_file()


def load_draft(directory: str | os.PathLike, target: LoadedModel) -> LoadedModel:
    """Attach a distilled draft to its target (same device and dtype as the target).

    Raises:
        ValueError: If the directory holds no draft, or the draft was made for a target
            of another shape or vocabulary.

    """
    path = pathlib.Path(directory)
    manifest = read_manifest(path, fingerprint(target.model), target.name)
    try:
        tensors = load_file(path / WEIGHTS)
    except (OSError, ValueError) as err:
        raise ValueError(f"{str(path)!r} does not hold a readable distilled draft: {err}") from err
    kind = manifest.get("kind", "layers")
    if kind == "features":
        model = feature_student(target.model, manifest["source_layers"])
    elif kind == "layers":
        model = student(target, manifest["source_layers"])
    else:
        raise ValueError(f"draft {str(path)!r} is of unknown kind {kind!r}")
    for prefix, module in draft_modules(model).items():
        state = {k.removeprefix(f"{prefix}."): v for k, v in tensors.items() if k.startswith(f"{prefix}.")}
        module.load_state_dict(state)  # strict: a missing or extra tensor is an error
        module.to(device=target.model.device, dtype=target.model.dtype)
    model.eval().requires_grad_(False)
    try:
        record = DraftRecord.from_json(manifest["record"]) if "record" in manifest else None
    except ValueError as err:
        raise ValueError(f"draft {str(path)!r} ships a bad draft record: {err}") from None
    return LoadedModel(model, target.tokenizer, draft_name(path), draft_source(path, manifest), record=record)


def save_record(directory: str | os.PathLike, record: DraftRecord, measured: dict) -> None:
    """Write ``record`` into a distilled draft's manifest, as the record its requests start from.

    ``measured``: how it was measured (prompts, settings), kept beside it.
    """
    path = pathlib.Path(directory) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest |= {"record": record.as_json(), "record_measured": measured}
    path.with_suffix(".tmp").write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(path.with_suffix(".tmp"), path)


def draft_name(path: pathlib.Path) -> str:
    """How a distilled draft is named in outputs and records."""
    return "default distilled draft" if path.resolve() == SHIPPED_DRAFT.resolve() else str(path)


def draft_source(path: pathlib.Path, manifest: dict) -> str:
    """Where a distilled draft came from, its shape and its target, in words."""
    kind = manifest.get("kind", "layers")
    shape = f"{len(manifest['source_layers'])} layers" + (
        ", reading the target's hidden states" if kind == "features" else ""
    )
    return f"distilled draft {path} ({shape}, for {manifest['target']})"


def resolve_draft(
    spec: str | None, target: LoadedModel, *, device: str | torch.device, dtype: str | torch.dtype
) -> LoadedModel:
    """Turn a draft specification into a model.

    Args:
        spec: ``None`` for the target's default draft (the shipped distilled draft for
            the default target, else a ``DEFAULT_DRAFT_LAYERS``-layer slice);
            ``"layers:N"`` for an N-layer slice; a directory made by ``smcsd distill``;
            anything else is passed to ``load_model``.
        target: The target model (slices and distilled drafts share its weights).
        device: Device for a separately loaded draft.
        dtype: Dtype for a separately loaded draft.

    Raises:
        ValueError: For a malformed spec or a draft that cannot be loaded.

    """
    if spec is None:
        if target.name == DEFAULT_TARGET and is_draft_dir(SHIPPED_DRAFT):
            return load_draft(SHIPPED_DRAFT, target)
        logger.info("no distilled draft for %s; using a %d-layer slice", target.name, DEFAULT_DRAFT_LAYERS)
        return slice_draft(target, DEFAULT_DRAFT_LAYERS)
    if spec.startswith("layers:"):
        count = spec.removeprefix("layers:")
        if not count.strip().isdigit():
            raise ValueError(f"bad draft spec {spec!r}; expected 'layers:N' with an integer N")
        return slice_draft(target, int(count))
    if is_draft_dir(pathlib.Path(spec).expanduser()):
        return load_draft(pathlib.Path(spec).expanduser(), target)
    draft = load_model(spec, device=device, dtype=dtype)
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        logger.warning("draft %r and target %r have different vocabularies", spec, target.name)
    return draft
