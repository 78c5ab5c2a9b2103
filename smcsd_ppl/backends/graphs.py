"""One graph per shape: a function of tensors compiled (CPU) or captured as a CUDA graph (CUDA).

``Graphed(fn, mode)`` calls ``fn(*tensors)`` as:
- ``"eager"``: itself, the reference every other mode is tested against;
- ``"compile"``: ``torch.compile(fullgraph=True, dynamic=False)``, one graph per shape, which
  fails loudly on a graph break (a host read inside ``fn``); torch caches it across processes;
- ``"cuda-graph"``: captured once per shape, then replayed. A replay reads the tensors it
  was captured with: later arguments are copied into them unless they are them (the KV
  arena, written in place, is passed as itself every time). Outputs are the captured
  buffers: read or copy them before the next replay.

``fn`` must read nothing back to the host and give outputs whose shapes follow from its
inputs' shapes only.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch

MODES = ("eager", "compile", "cuda-graph")


class Graphed:
    """``fn`` run as ``mode`` says; ``seconds`` is the time spent compiling or capturing."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"graph mode must be one of {MODES}, got {mode!r}")
        self.fn, self.mode, self.seconds = fn, mode, 0.0
        self.compiled = None
        if mode == "compile":
            # Not frozen: freezing the weights into the graph measured no faster here (AR 1.16x eager
            # against 1.20x, float32, embedded target) and keeps torch from caching the compiled
            # graph across processes (44 s to compile again, against 5 s from the cache).
            self.compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        self.captured: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple, tuple]] = {}
        self.shapes: set[tuple] = set()

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``fn(*args)``: compiled or replayed after the first call at these shapes."""
        if self.mode == "eager":
            return self.fn(*args)
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        if self.mode == "compile":
            if key in self.shapes:
                return self.compiled(*args)
            start = time.perf_counter()
            with warnings.catch_warnings():  # torch's compiler imports a module it has deprecated itself
                warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
                out = self.compiled(*args)  # the first call at a shape compiles it
            self.shapes.add(key)
            self.seconds += time.perf_counter() - start
            return out
        if key not in self.captured:
            start = time.perf_counter()
            self.captured[key] = _capture(self.fn, args)
            self.seconds += time.perf_counter() - start
        graph, inputs, outputs = self.captured[key]
        for buffer, arg in zip(inputs, args):
            if buffer.data_ptr() != arg.data_ptr():
                buffer.copy_(arg)
        graph.replay()
        return outputs


def _capture(fn: Callable, args: tuple[torch.Tensor, ...]) -> tuple:
    """Warm ``fn`` up on a side stream, then capture it over ``args`` themselves.

    The warm-up runs ``fn`` for real, and ``fn`` writes its buffers in place (the arena, the
    lengths): they are saved before and put back after, so the capture (which runs nothing)
    starts from the caller's state and the first replay is the call itself.
    """
    saved = [a.clone() for a in args]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    for a, s in zip(args, saved):
        a.copy_(s)
    del saved
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*args)
    return graph, args, tuple(outputs)
