"""What this CPU multiplies natively, and what a verified row costs because of it.

A CPU without native bfloat16 (or float16) matrix instructions converts every operand of a
half-precision matrix product: one row (a matrix-vector product, memory-bound) is still
cheap, but every further row costs nearly as much again. On such a CPU SMC-SD's rows are
about eight times dearer than in float32 (docs/benchmarks.md, "What a row costs").
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch

# r, one verified position of one row relative to a one-token target step, for half
# precision emulated on the CPU: the embedded 135M target in bf16 on a 2-core AVX2 EPYC took
# 41 ms for 1 row x 1 token and 1,242 ms for 8 rows x 9 tokens: (1242 / 41 - 1) / 71 = 0.41.
# (float32 on the same CPU: 70 and 314 ms, 0.05, as native bf16 on AMX.)
EMULATED_HALF_ROW_POSITION_COST = 0.4
NATIVE_ROW_POSITION_COST = 0.05  # where the CPU multiplies the dtype natively (float32 above)

# Flags (Linux /proc/cpuinfo) that mean native matrix products in each half type.
_NATIVE_FLAGS = {
    torch.bfloat16: {"avx512_bf16", "amx_bf16", "bf16"},  # x86 AVX-512 / AMX, and Arm's BF16
    torch.float16: {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"},
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where ``/proc/cpuinfo`` cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def native_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices natively (float32 always; unknown: no)."""
    if dtype == torch.float32 or dtype == torch.float64:
        return True
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return dtype == torch.float16  # Apple silicon: fp16 in hardware
    return bool(cpu_flags() & _NATIVE_FLAGS.get(dtype, set()))


def row_position_cost(dtype: torch.dtype) -> float | None:
    """A CPU backend's r for ``dtype`` when emulation makes rows dear; None: the CPU's usual figure."""
    return None if native_matmul(dtype) else EMULATED_HALF_ROW_POSITION_COST


@dataclass(frozen=True)
class CPUTricks:
    """What a backend on a CPU does because a CPU pays for every row and position it computes.

    Each changes how a forward is computed, never what it returns (beyond the rounding of its
    products); each is on by default on a CPU and off on an accelerator, where rows come
    almost free. ``--deterministic`` turns them off: each makes a forward's shapes depend on
    what its batch-mates hold.

    Attributes:
        twins: rows holding the same tokens and fed the same compute once (``backends.twins``).
        flatten: a feed of unlike counts runs its real tokens alone, in one forward
            (``backends.ragged``).
        few_rows: our forward's products of at most ``llama.FEW`` positions take the weight on
            the left (``backends.products``; float32 on MKL).
    """

    twins: bool = True
    flatten: bool = True
    few_rows: bool = True


NO_TRICKS = CPUTricks(twins=False, flatten=False, few_rows=False)
