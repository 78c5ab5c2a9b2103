"""CUDA graphs of the shaped backend's forwards (``backends.graphs``): on a GPU only.

Without one these skip; ``smcsd device-check --device cuda`` runs the same path at an 8B
model's shapes where a GPU is at hand.
"""

from __future__ import annotations

import pytest
import tiny
import torch

from smcsd_ppl.backends.fixed import Buckets, ShapedLM
from smcsd_ppl.backends.graphs import CudaGraphs, RecaptureLimit
from smcsd_ppl.backends.llama import LlamaForward

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _backend(graphs):
    model = tiny.llama(seed=0, layers=3).cuda()
    return ShapedLM(model, Buckets(step=64), graphs=graphs, compiled=LlamaForward(model))


@cuda
def test_a_replayed_forward_gives_the_launched_one_s_logits():
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    graphed, launched = _backend(CudaGraphs()), _backend(None)
    for lm in (graphed, launched):
        lm.prefill(prompts)
    for step in range(4):  # the first call captures, the others replay
        tokens = torch.full((3, 2), 20 + step, device="cuda")
        torch.testing.assert_close(graphed.extend(tokens), launched.extend(tokens), rtol=1e-4, atol=1e-4)
    assert len(graphed.graphs.graphs) == 1


@cuda
def test_buffers_that_keep_moving_raise_instead_of_launching_in_silence():
    graphs = CudaGraphs(max_recaptures=1)
    lm = _backend(graphs)
    lm.prefill([[5, 6, 7]])
    with pytest.raises(RecaptureLimit, match="captured 3 times"):
        for _ in range(3):
            lm.generation += 1  # the cache's buffers moved: a graph of the old ones reads stale memory
            lm.extend(torch.full((1, 1), 9, device="cuda"))
