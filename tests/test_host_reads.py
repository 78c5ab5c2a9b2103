"""Host reads per cycle: the syncs an accelerator would pay, counted on the CPU.

``backends.syncs.HostReads`` follows values from the models' weights through every
torch op and counts the reads of such values by the host (``.tolist()``, ``.item()``,
``bool()``, ``.cpu()``, data-dependent shapes). Drafting's early stop on EOS reads
the device each step on a CPU only (where it is free); it is turned off here so the
counts are those of the accelerator path.

Budgets (reads per cycle = between two target forwards):
- AR: 1 (the sampled tokens), 2 on every 16th token (the NaN flag);
- exact SD: 4 (drafted tokens, their log q, the accept verdicts, the NaN flags);
- SMC-SD, the paper's and the default (its cut, adaptive length, the target alone): 1, the
  drafted tokens read with the verdict (NaN logits show as NaN weights there);
- constrained SMC-SD: 1, and 4 per drafting step (the drafted tokens, mirrored on the host
  once per step for the constraint's next masks; the per-row mass check; which rows still
  draft; the early stop), not one per row and drafted token.
"""

from __future__ import annotations

import dataclasses

import pytest
import tiny
import torch

from smcsd_ppl.api import SMCSD
from smcsd_ppl.backends.syncs import HostReads, reads_per_cycle
from smcsd_ppl.config import DraftRecord, SMCConfig
from smcsd_ppl.engine.worker import entered_on_torch_thread
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.potentials import Constraint

K = 4
CFG = SMCConfig(n_particles=8, block_size=K, max_new_tokens=24, ignore_eos=True, seed=0)
BUDGET = {"sd": 4, "smcsd": 1, "smcsd_paper": 1}


@pytest.fixture(scope="module")
def smc():
    target, draft = tiny.pair()
    pair = SMCSD(target, draft)
    pair.rows().free_reads = False  # the pair's one store, read as on an accelerator
    pair.target_lm.shares_twins = pair.draft_lm.shares_twins = False  # so are the backends
    return pair


def counted(smc, run) -> list[int]:
    counter = reads_per_cycle(smc.target_lm, [smc.target.model, smc.draft.model])
    with entered_on_torch_thread(counter) as counts:  # the models run on the torch thread
        run()
    assert len(counts) >= 4, "too few cycles to judge"
    assert any(counts), "no reads seen: the counter is not where the models run"
    return counts[1:]  # the first includes the setup (prefill, first token, forks)


def test_autoregressive_reads_the_tokens_once_per_token(smc):
    counts = counted(smc, lambda: smc.generate("The quick brown fox", method="ar", config=CFG))
    assert max(counts) <= 2
    assert sum(c > 1 for c in counts) <= len(counts) // 16 + 1, counts


@pytest.mark.parametrize("method", ["sd", "smcsd", "smcsd_paper"])
def test_speculative_cycles_stay_within_budget(smc, method):
    counts = counted(smc, lambda: smc.generate("The quick brown fox", method=method, config=CFG))
    assert max(counts) <= BUDGET[method], counts


@pytest.mark.parametrize("drafts", [True, False])
def test_the_default_method_reads_once_per_cycle_drafting_or_alone(smc, drafts):
    """The default method's cycles, drafting under a loose cut, or decoding with the target alone."""
    cfg = dataclasses.replace(CFG, cut=0.99)
    record = DraftRecord(1000, 1, row_cost=0.0) if drafts else DraftRecord(0, 1000, row_cost=0.0)
    before = smc.draft_lm.stats.calls
    counts = counted(smc, lambda: smc.engine.run([SMCSDModel([5, 6, 7])], cfg, record=record)[0].wait())
    assert (smc.draft_lm.stats.calls > before) == drafts
    assert max(counts) <= 1, counts


class EvenTokens(Constraint):
    """Allows even token ids only (any context)."""

    def next_mask(self, contexts):
        mask = torch.zeros(len(contexts), len(tiny.tokenizer()), dtype=torch.bool)
        mask[:, ::2] = True
        return mask


def test_constrained_drafting_reads_once_per_step(smc):
    cfg = dataclasses.replace(CFG, n_particles=4)
    programs = [SMCSDModel([5, 6, 7], constraint=EvenTokens())]
    counts = counted(smc, lambda: smc.run(programs, cfg))
    assert max(counts) <= BUDGET["smcsd"] + 4 * K, counts


def test_counter_sees_reads_of_model_outputs_only():
    model = tiny.llama(layers=1)
    host = torch.tensor([1, 2, 3])
    with HostReads([model]) as mode:
        logits = model(host[None]).logits
        host.tolist(), int(host[0])  # host data: free
        assert mode.count == 0
        top = logits[0, -1].argmax()
        int(top), logits.cpu(), bool((logits > 0).any()), torch.nonzero(logits[0, 0] > 0)
        assert mode.count == 4
        copy = logits.cpu()  # once on the host, reading it is free
        copy.tolist()
        assert mode.count == 5
        buf = torch.zeros(3)
        buf[0] = logits[0, 0, 0]  # writing a model value taints the buffer
        buf.tolist()
        assert mode.count == 6
