"""CUDA graphs of a backend's forwards: one capture per shape, replayed after.

On an accelerator a small model's forward costs its kernel launches, not its arithmetic (an 8B
forward took 27-50 ms on an H200 for 1 or 72 positions, 3.4 ms of them weight reads). A CUDA
graph launches a whole forward at once. ``CudaGraphs.run(key, fn, inputs)`` captures
``fn(*inputs)`` the first time it meets ``key`` and replays it after, copying each call's
inputs into the captured ones. What the graph reads besides its inputs (the KV cache, the
weights) is read where it was at the capture, so a key must change with any buffer that moves
(``fixed.ShapedLM`` keys by the cache's generation).

Every graph draws from one memory pool; at most ``max_graphs`` are kept (the least recently
used is dropped); a key captured again more than ``max_recaptures`` times (its buffers keep
moving: shapes that do not settle) raises instead of falling back to launches in silence.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch


class RecaptureLimit(RuntimeError):
    """A forward's graph kept being captured again: its shapes or buffers do not settle."""


class CudaGraphs:
    """Captured forwards by key, sharing one memory pool.

    Args:
        max_graphs: graphs kept at once (least recently used dropped first).
        max_recaptures: captures of one key's shape past its first before ``RecaptureLimit``.
    """

    def __init__(self, max_graphs: int = 64, max_recaptures: int = 8) -> None:
        self.max_graphs, self.max_recaptures = max_graphs, max_recaptures
        self.graphs: OrderedDict[Hashable, tuple] = OrderedDict()
        self.captures: dict[Hashable, int] = {}
        self.pool = None

    def run(self, key: Hashable, shape: Hashable, fn: Callable, inputs: Sequence[torch.Tensor]):
        """``fn(*inputs)``, from the graph of ``key`` (captured now if new).

        ``shape``: what of the key is the forward's shape (its recaptures are counted apart from
        the buffers' generation). Returns the graph's own output tensors: read or copy them
        before the next run of the same key.
        """
        if key not in self.graphs:
            self.captures[shape] = self.captures.get(shape, 0) + 1
            if self.captures[shape] > self.max_recaptures + 1:
                raise RecaptureLimit(
                    f"the forward of shape {shape} was captured {self.captures[shape]} times: its buffers "
                    "keep moving (use --forward reference to run it without graphs)"
                )
            self.graphs[key] = self._capture(fn, inputs)
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        graph, captured, outputs = self.graphs[key]
        for mine, given in zip(captured, inputs):
            if mine.data_ptr() != given.data_ptr():
                mine.copy_(given)
        graph.replay()
        return outputs

    def _capture(self, fn: Callable, inputs: Sequence[torch.Tensor]) -> tuple:
        """Warm ``fn`` up on a side stream, then capture it over copies of ``inputs``.

        The warm-up runs ``fn`` for real and ``fn`` writes the cache: the capture runs nothing,
        so the first replay (the call itself) writes what the call should.
        """
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        captured = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*captured)  # kernels chosen, workspaces allocated, before the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*captured)
        return graph, captured, outputs
