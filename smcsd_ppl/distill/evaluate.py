"""How well a draft matches its target: agreement, acceptance, the quality cut, SMC-SD, cost.

- *agreement*: how often the draft's most likely next token is the target's, on the
  target's greedy continuations of held-out prompts (a feature draft is run as in
  decoding: blocks of ``block_size`` tokens, its own predicted states inside a block);
- *acceptance at T*: the mean of sum_v min(p_T(v), q_T(v)) = E_{x~q}[min(1, p/q)], the
  probability that exact speculative sampling accepts a drafted token, with both models
  at temperature T, at the same positions;
- *pass rate at T*: the share of those positions the default quality cut keeps
  (TV(p_T, q_T) = 1 - acceptance <= cut), and *Renyi-2 at T*: the mean log second moment
  log sum_v p_T^2/q_T of an SMC-SD weight increment over the kept ones;
- *SMC-SD* (``smc_metrics``): what default SMC-SD does with the draft on the prompts:
  tokens per target call, ESS / N, and what its schedule chose (draft lengths, the target
  alone) with the draft's pass rate that led it there;
- *cost*: one draft forward over 8 rows against one target forward over 1 row (one new
  token each after a cached context, through the engine's batched backend), timed
  interleaved in one process (medians).
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import transformers

from ..backends.hf import HFBatchedLM
from ..config import DraftRecord, SMCConfig
from ..models.feature_draft import final_hidden
from .data import Example, right_padded
from .objectives import renyi2

if TYPE_CHECKING:
    from ..api import SMCSD
    from ..results import Generation

DEFAULT_CUT = SMCConfig().cut  # the TV cut default SMC-SD runs with


def _logits(model: transformers.PreTrainedModel, examples: Sequence[Example]) -> list[torch.Tensor]:
    """Each example's next-token logits at its continuation positions (float32)."""
    device = model.device
    ids, mask = right_padded([e.ids for e in examples], device)
    # A draft in training keeps fp32 layers next to the target's bf16 head: autocast joins them.
    head = model.get_output_embeddings().weight.dtype
    mixed = any(p.dtype != head for p in model.parameters())
    with torch.autocast(device.type, dtype=head, enabled=mixed):
        logits = model(input_ids=ids, attention_mask=mask).logits
    # positions start-1 .. len-2 predict the continuation tokens
    return [logits[row, max(e.start, 1) - 1 : len(e.ids) - 1].float() for row, e in enumerate(examples)]


def _block_logits(
    target: transformers.PreTrainedModel, draft: torch.nn.Module, example: Example, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and feature-draft logits at an example's continuation positions, drafted in blocks.

    As in decoding, the first token of each block is predicted from the target's true
    states and the next ``block_size - 1`` from the draft's own; then the block's tokens
    are fed again with the target's states.
    """
    ids = example.ids[None].to(target.device)
    hidden = final_hidden(target, ids, torch.ones_like(ids))[0]  # [L, H]
    first, end = max(example.start, 1), len(example.ids)  # predict x_first .. x_{end-1}
    p = target.get_output_embeddings()(hidden[first - 1 : end - 1]).float()
    lm = HFBatchedLM(draft, name="draft")
    zero = hidden.new_zeros(1, hidden.shape[-1])
    out = [lm.prefill([ids[0, :first].tolist()], [torch.cat([zero, hidden[: first - 1]])])]
    j = first
    while j < end:
        n = min(block_size, end - j)
        for step in range(1, n):  # x_j .. x_{j+n-2} with predicted states
            state = lm.hidden[:, -1:]
            out.append(lm.extend(ids[:, j + step - 1 : j + step], hidden=state)[:, -1])
        if n > 1:
            lm.drop_tail(torch.tensor([n - 1]))
        if j + n < end:  # the block again, with the target's states; predicts x_{j+n}
            out.append(lm.extend(ids[:, j : j + n], hidden=hidden[None, j - 1 : j + n - 1])[:, -1])
        j += n
    return p, torch.cat(out).float()


@torch.inference_mode()
def match_metrics(
    target: transformers.PreTrainedModel,
    draft: torch.nn.Module,
    examples: Sequence[Example],
    *,
    temperatures: Sequence[float] = (1.0, 0.7),
    batch_size: int = 8,
    block_size: int = 8,
    cut: float = DEFAULT_CUT,
) -> dict[str, float]:
    """Agreement, acceptance and the TV ``cut``'s pass rate and kept Renyi-2 of ``draft`` with ``target``.

    ``block_size`` is the drafted block length a feature draft is run with. Renyi-2 is
    None at a temperature where no position passes.
    """
    if not examples:
        raise ValueError("no examples to evaluate on")
    agree, count = 0.0, 0
    accept, kept, renyi = ({t: 0.0 for t in temperatures} for _ in range(3))
    for first in range(0, len(examples), batch_size):
        group = examples[first : first + batch_size]
        if getattr(draft, "reads_hidden", False):
            head = draft.get_output_embeddings().weight.dtype
            with torch.autocast(draft.device.type, dtype=head, enabled=draft.dtype != head):
                pairs = [_block_logits(target, draft, e, block_size) for e in group]
        else:
            pairs = zip(_logits(target, group), _logits(draft, group), strict=True)
        for p, q in pairs:
            agree += float((p.argmax(-1) == q.argmax(-1)).sum())
            for t in temperatures:
                log_p, log_q = torch.log_softmax(p / t, -1), torch.log_softmax(q / t, -1)
                overlap = torch.minimum(log_p, log_q).exp().sum(-1)
                passed = 1 - overlap <= cut  # the TV cut: TV = 1 - overlap
                accept[t] += float(overlap.sum())
                kept[t] += float(passed.sum())
                renyi[t] += float(renyi2(log_p, log_q)[passed].sum())
            count += len(p)
    if count == 0:
        raise ValueError("the examples hold no continuation tokens")
    out: dict = {"positions": count, "agreement": agree / count}
    for t in temperatures:
        out[f"acceptance_T{t:g}"] = accept[t] / count
        out[f"pass_T{t:g}"] = kept[t] / count
        out[f"renyi2_T{t:g}"] = renyi[t] / kept[t] if kept[t] else None
    return out


def smc_metrics(
    pair: SMCSD,
    texts: Sequence[str],
    config: SMCConfig | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> dict:
    """SMC-SD with ``pair``'s draft on each text, one request at a time: ``smc_summary`` of the outputs.

    Every request starts from an empty draft record (it probes the draft itself), so the
    schedule's choices are this draft's alone. ``config``: ``SMCConfig()`` when None;
    ``on_progress`` gets the requests done.
    """
    if pair.draft_record != DraftRecord():
        raise ValueError("the pair carries a learned draft record; measure a draft from an empty one")
    if not texts:
        raise ValueError("no prompts to run SMC-SD on")
    outs = []
    for text in texts:
        outs.append(pair.generate(text, method="smcsd", config=config or SMCConfig()))
        if on_progress is not None:
            on_progress(len(outs))
    return smc_summary(outs)


def smc_summary(outs: Sequence[Generation]) -> dict:
    """What SMC-SD did over ``outs`` (each its own call), pooled over requests and cycles.

    Returns tokens per target call (prefill included), the mean ESS / N over cycles that ran
    two particles or more, the cycles run, the share of cycles the schedule gave to the
    target alone, the mean length of the cycles that drafted, how many cycles drafted each
    length, and the draft's pass rate at the cut (kept positions / (kept + cuts that fired)),
    with its two counts (the evidence a draft record holds).
    Without a cut (the paper's algorithm) there is no schedule: its entries are None.
    """
    tokens = sum(len(o.token_ids) for o in outs)
    calls = sum(o.stats.target_calls for o in outs)
    ess = [e / n for o in outs for e, n in zip(o.smc.ess_trace, o.smc.particle_trace) if n >= 2]
    lengths = [n for o in outs for n in o.smc.draft_lengths]
    drafted = [n for n in lengths if n]
    passed = sum(o.smc.draft_record.passed for o in outs)
    seen = passed + sum(o.smc.draft_record.failed for o in outs)
    return {
        "smc_tokens_per_target_call": tokens / max(1, calls),
        "smc_ess_fraction": statistics.fmean(ess) if ess else None,
        "smc_cycles": sum(len(o.smc.particle_trace) for o in outs),
        "smc_target_alone": (len(lengths) - len(drafted)) / len(lengths) if lengths else None,
        "smc_draft_length": statistics.fmean(drafted) if drafted else (0.0 if lengths else None),
        "smc_lengths": {str(n): lengths.count(n) for n in sorted(set(lengths))},
        "smc_pass_rate": passed / seen if seen else None,
        "smc_passed": passed,
        "smc_failed": seen - passed,
    }


@torch.inference_mode()
def forward_cost(
    target: transformers.PreTrainedModel,
    draft: transformers.PreTrainedModel,
    *,
    draft_rows: int = 8,
    context: int = 128,
    repeats: int = 30,
    seed: int = 0,
) -> dict[str, float]:
    """Median ms of one draft forward over ``draft_rows`` rows and one target forward over 1 row.

    Both decode one token after a cached context of ``context`` tokens (fewer if the models
    are shorter); the two are timed in alternation so that machine load affects both alike.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    limit = min(getattr(m.config, "max_position_embeddings", context + 1) for m in (target, draft))
    context = min(context, limit - 1)  # room for the timed token

    def prepare(model, rows):
        lm = HFBatchedLM(model, name="cost")
        size = target.config.hidden_size
        feats = [torch.randn(context, size, generator=gen)] * rows if lm.reads_hidden else None
        lm.prefill(torch.randint(0, vocab, (rows, context), generator=gen).tolist(), feats)
        step = torch.randint(0, vocab, (rows, 1), generator=gen)
        extra = {"hidden": torch.randn(rows, 1, size, generator=gen)} if lm.reads_hidden else {}
        return (step, extra), lm

    def timed(lm, inputs) -> float:
        step, extra = inputs
        if lm.device.type == "cuda":
            torch.cuda.synchronize(lm.device)
        start = time.perf_counter()
        lm.extend(step, **extra)
        if lm.device.type == "cuda":
            torch.cuda.synchronize(lm.device)
        lm.drop_tail(torch.ones(step.shape[0], dtype=torch.long))  # back to the context
        return (time.perf_counter() - start) * 1000

    d_step, d_lm = prepare(draft, draft_rows)
    t_step, t_lm = prepare(target, 1)
    for _ in range(3):  # warm-up
        timed(d_lm, d_step), timed(t_lm, t_step)
    d_ms, t_ms = [], []
    for _ in range(repeats):
        d_ms.append(timed(d_lm, d_step))
        t_ms.append(timed(t_lm, t_step))
    d, t = statistics.median(d_ms), statistics.median(t_ms)
    return {"draft_ms": d, "target_ms": t, "ratio": d / t, "draft_rows": draft_rows, "context": context}


def plot_curve(log_path: str | os.PathLike, png_path: str | os.PathLike) -> bool:
    """Plot held-out agreement and acceptance against training tokens from a ``train_log.jsonl``.

    Returns False (and writes nothing) when the log holds no held-out evaluation.
    """
    from ..plots import STYLE, finish_plot, matplotlib_or_say

    matplotlib = matplotlib_or_say()
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    records = [json.loads(line) for line in pathlib.Path(log_path).read_text().splitlines() if line.strip()]
    records = [r for r in records if "agreement" in r]
    if not records:
        return False
    tokens = [r["tokens"] / 1e6 for r in records]
    series = {
        "agreement (top-1)": "agreement",
        "acceptance, T=1": "acceptance_T1",
        "acceptance, T=0.7": "acceptance_T0.7",
    }
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(7.5, 4.8), layout="constrained")
        ax = fig.add_subplot()
        for label, key in series.items():
            ax.plot(tokens, [r[key] for r in records], marker="o", label=label)
        finish_plot(
            fig,
            ax,
            png_path,
            xlabel="training tokens (millions)",
            ylabel="held-out, against the target",
            ylim=(0, 1),
        )
    return True
