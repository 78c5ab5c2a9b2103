"""A vLLM pair's models as files: tokenizer, config and LM head, and no PyTorch model.

The vLLM backend runs each model on its engine and applies the LM head itself, so nothing
else of a model is needed outside the engine. ``load_files`` reads a model's tokenizer and
config, ``engine_parts`` its head's tensor (the embeddings, where they are tied) from the
checkpoint's safetensors, and ``draft_files`` writes a draft that exists only as part of its
target (a layer slice, a distilled draft) once under the cache as a checkpoint of its own,
made from the target's and the draft's files: each model's weights are loaded once, by its engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from ..backends.vllm import EngineParts
from ..backends.vllm_export import write_once
from .drafts import (
    DEFAULT_DRAFT_LAYERS,
    SHIPPED_DRAFT,
    WEIGHTS,
    config_fingerprint,
    draft_name,
    draft_source,
    is_draft_dir,
    read_manifest,
)
from .layers import layer_config
from .loading import (
    _EMBEDDED_SOURCE,
    DEFAULT_TARGET,
    LoadedModel,
    _parse_device,
    _parse_dtype,
    embedded_default_dir,
    hub_reachable,
)

logger = logging.getLogger(__name__)

# What a model's directory needs besides weights in other formats (.bin, .pth, .gguf).
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
# Config fields of models whose logits are not their head applied to the last state.
SCALED_LOGITS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}
_LAYER = re.compile(r"^(?P<prefix>.*?)layers\.(?P<index>\d+)\.(?P<rest>.+)$")


def load_files(name: str | None, *, device: str | torch.device, dtype: str | torch.dtype) -> LoadedModel:
    """A model's tokenizer and the directory of its weights, for its engine (``model`` is None).

    Args:
        name: as ``load_model``'s: a hub id, a local directory, or None for the embedded default.
        device: where the LM head will live.
        dtype: what the engine and the head run in.

    Raises:
        ValueError: for a bad device or dtype, or a model that cannot be found.
    """
    dev = _parse_device(device)
    dt = _parse_dtype(dtype, dev)
    directory, shown, source = _model_dir(name)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return LoadedModel(None, tokenizer, shown, source, path=str(directory), dtype=dt, device=dev)


def _model_dir(name: str | None) -> tuple[pathlib.Path, str, str]:
    """A model's local directory, its name and where it came from (as ``load_model`` resolves it)."""
    from huggingface_hub import snapshot_download

    if not name or name in ("default", DEFAULT_TARGET):
        try:
            path = snapshot_download(DEFAULT_TARGET, local_files_only=True, allow_patterns=HUB_FILES)
            return pathlib.Path(path), DEFAULT_TARGET, "hub"
        except Exception as err:  # noqa: BLE001 - not in the hub cache, whatever the hub client says
            logger.info("%s not in hub cache (%s); using embedded copy", DEFAULT_TARGET, type(err).__name__)
        return embedded_default_dir(), DEFAULT_TARGET, _EMBEDDED_SOURCE
    local = pathlib.Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ValueError(f"{name!r} is a directory but holds no model (no config.json)")
        return local, name, f"local path {local}"
    offline = not hub_reachable()
    try:
        return (
            pathlib.Path(snapshot_download(name, local_files_only=offline, allow_patterns=HUB_FILES)),
            name,
            "hub",
        )
    except Exception as err:
        where = "the local hub cache (the hub is not reachable)" if offline else "the hub"
        raise ValueError(f"could not find model {name!r} in {where}: {err}") from err


def draft_files(spec: str | None, target: LoadedModel, cache_root: pathlib.Path) -> LoadedModel:
    """``resolve_draft`` for a target loaded by ``load_files``: a draft as files, its engine's to load.

    A layer slice or a distilled draft is written once under ``cache_root/vllm`` from the target's
    checkpoint (and the draft's own tensors), keyed by what it is made of.
    """
    if spec is None:
        if target.name == DEFAULT_TARGET and is_draft_dir(SHIPPED_DRAFT):
            return _distilled(SHIPPED_DRAFT, target, cache_root)
        return _slice(target, DEFAULT_DRAFT_LAYERS, cache_root)
    if spec.startswith("layers:"):
        count = spec.removeprefix("layers:")
        if not count.strip().isdigit():
            raise ValueError(f"bad draft spec {spec!r}; expected 'layers:N' with an integer N")
        return _slice(target, int(count), cache_root)
    if is_draft_dir(pathlib.Path(spec).expanduser()):
        return _distilled(pathlib.Path(spec).expanduser(), target, cache_root)
    draft = load_files(spec, device=target.device, dtype=target.dtype)
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        logger.warning("draft %r and target %r have different vocabularies", spec, target.name)
    return draft


def _slice(target: LoadedModel, n_layers: int, cache_root: pathlib.Path) -> LoadedModel:
    total = AutoConfig.from_pretrained(target.path).num_hidden_layers
    if not 1 <= n_layers < total:
        raise ValueError(f"slice size must be an integer in [1, {total - 1}], got {n_layers!r}")
    path = _write_layers(target, list(range(n_layers)), None, cache_root)
    source = f"layer slice: first {n_layers} of {total} layers of {target.name}"
    return _files_like(target, path, f"layers:{n_layers}", source, is_slice=True)


def _distilled(path: pathlib.Path, target: LoadedModel, cache_root: pathlib.Path) -> LoadedModel:
    manifest = read_manifest(path, config_fingerprint(AutoConfig.from_pretrained(target.path)), target.name)
    if manifest.get("kind", "layers") != "layers":
        raise ValueError(
            f"the vLLM backend cannot run the draft {str(path)!r}: feature drafts read the target's states"
        )
    written = _write_layers(target, [int(i) for i in manifest["source_layers"]], path / WEIGHTS, cache_root)
    return _files_like(target, written, draft_name(path), draft_source(path, manifest))


def _files_like(
    target: LoadedModel, path: str, name: str, source: str, *, is_slice: bool = False
) -> LoadedModel:
    return LoadedModel(
        None, target.tokenizer, name, source, is_slice, path=path, dtype=target.dtype, device=target.device
    )


def _write_layers(
    target: LoadedModel, indices: list[int], own: pathlib.Path | None, cache_root: pathlib.Path
) -> str:
    """A checkpoint of the target's layers ``indices`` (``own``'s layers and norm instead, if given).

    Written once, atomically, under ``cache_root/vllm``; the key covers the files it is made of.
    """
    files = tensor_files(target.path)
    made_of = sorted({(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files.values()})
    if own is not None:
        made_of.append(hashlib.sha256(own.read_bytes()).hexdigest())
    key = json.dumps([made_of, indices, str(target.dtype)])
    final = cache_root / "vllm" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (final / "config.json").is_file():
        return str(final)
    tensors = _layer_tensors(files, indices, own, target.dtype)

    def write(tmp: pathlib.Path) -> None:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        config = layer_config(AutoConfig.from_pretrained(target.path), indices)
        config.dtype = target.dtype  # what its tensors are in
        config.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)

    return write_once(final, write)


def _layer_tensors(
    files: dict[str, pathlib.Path], indices: list[int], own: pathlib.Path | None, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The tensors of the model of layers ``indices`` (renumbered); the rest the target's, or own norm."""
    position = {i: j for j, i in enumerate(indices)}
    prefix = next((m["prefix"] for name in files if (m := _LAYER.match(name))), None)
    if prefix is None:
        raise ValueError("drafts made of target layers need a checkpoint with numbered `layers.N.` tensors")
    mine = {} if own is None else _read(own, dtype)
    plan = {}  # tensor name in the draft -> the target's tensor it is, or None: the draft's own
    for name in files:
        m = _LAYER.match(name)
        if m and m["prefix"] == prefix:
            if int(m["index"]) in position:
                plan[f"{prefix}layers.{position[int(m['index'])]}.{m['rest']}"] = None if own else name
        elif own is None or not name.startswith(f"{prefix}norm."):
            plan[name] = name
        else:
            plan[name] = None
    needed = {n.removeprefix(prefix) for n, src in plan.items() if src is None}
    if needed != set(mine):
        raise ValueError(f"the draft's tensors do not match its target's: {sorted(needed ^ set(mine))[:3]}")
    return {
        n: mine[n.removeprefix(prefix)] if src is None else _cast(_get(files[src], src), dtype)
        for n, src in plan.items()
    }


def tensor_files(directory: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """The safetensors file of each tensor of a checkpoint, by name."""
    directory = pathlib.Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {k: directory / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            found |= dict.fromkeys(f.keys(), path)
    if not found:
        raise ValueError(
            f"{str(directory)!r} holds no safetensors weights; the vLLM backend reads the LM head from them"
        )
    return found


def engine_parts(model: LoadedModel) -> EngineParts:
    """A model loaded by ``load_files``, for its engine: the head read from its checkpoint.

    Raises:
        ValueError: a model whose logits are scaled or soft-capped after the head, or whose
            checkpoint holds no head (nor tied embeddings).
    """
    config = json.loads((pathlib.Path(model.path) / "config.json").read_text())
    for field, plain in SCALED_LOGITS.items():
        if config.get(field, plain) != plain:
            raise ValueError(
                f"the vLLM backend cannot run {model.name!r}: its logits are not its LM head applied to its "
                f"last hidden state ({field} = {config[field]}); use the HF backend"
            )
    files = tensor_files(model.path)
    tied = [n for n in files if n.endswith("embed_tokens.weight")]
    name = "lm_head.weight" if "lm_head.weight" in files else (tied[0] if len(tied) == 1 else None)
    if name is None:
        raise ValueError(
            f"the checkpoint of {model.name!r} holds no lm_head.weight nor one embed_tokens.weight"
        )
    head = _cast(_get(files[name], name), model.dtype).to(model.device)
    bias = files.get("lm_head.bias")
    bias = None if bias is None else _cast(_get(bias, "lm_head.bias"), model.dtype).to(model.device)
    return EngineParts(model.path, head, bias, config.get("max_position_embeddings"), _count(files))


def _get(path: pathlib.Path, name: str) -> torch.Tensor:
    with safe_open(path, "pt") as f:
        return f.get_tensor(name)


def _read(path: pathlib.Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: _cast(f.get_tensor(k), dtype) for k in f.keys()}


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _count(files: dict[str, pathlib.Path]) -> int:
    """Parameters in the checkpoint (from the files' headers; nothing is read)."""
    total = 0
    for path in set(files.values()):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                total += torch.Size(f.get_slice(k).get_shape()).numel()
    return total
