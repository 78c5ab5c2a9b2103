"""Training a draft by distillation on the target's top-k next-token distribution.

The draft is a few of the target's own decoder layers, copied and trained, that may also
read the target's hidden states (``drafts.student``, ``feature_draft.feature_student``);
the target's embeddings and LM head are shared and frozen. The loss at every position is
the cross-entropy of the draft against the target's stored top-k distribution (the KL up
to a constant), or the variance of SMC-SD's weights under the quality cut (``objectives``);
a feature draft also regresses the target's hidden states, and is trained on its own
predicted states too (``unroll`` passes), as it runs inside a block. A
checkpoint (weights, optimizer, schedule, data cursor, RNG) is written atomically every
``save_every`` steps, so an interrupted run resumes exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..models import LoadedModel
from ..models.drafts import MANIFEST, draft_modules, fingerprint, load_draft, save_draft, student
from ..models.feature_draft import feature_student
from .data import Example
from .evaluate import match_metrics
from .losses import Objective, feature_kd_loss, hidden_states, kd_loss

CHECKPOINT = "checkpoint.pt"
LOG = "train_log.jsonl"
DRAFT_SUBDIR = "draft"


@dataclass(frozen=True)
class DistillConfig:
    """Settings of one distillation run.

    Attributes:
        kind: ``"layers"`` (a stack of target layers) or ``"features"`` (the same, also
            reading the target's hidden states; ``feature_draft``).
        init_draft: a saved layer draft (directory) to start from: its layers and norm are
            loaded (a feature draft first ignores the states), e.g. to fine-tune a KL-trained
            draft on a weight objective.
        layers: decoder layers of the draft, initialised from the target's first ``layers``
            layers (they keep the residual stream the embeddings feed: measured on
            SmolLM2-135M, agreement starts at 0.06 from layers 0-3 but at 0.00 from layers
            spread over the depth or ending with the last one).
        source_layers: explicit target layer indices to start from instead.
        steps: optimizer steps.
        batch_tokens: padded tokens per batch (sequences are grouped by length).
        lr: peak learning rate (linear warm-up, cosine decay to a tenth).
        warmup: warm-up steps.
        weight_decay: AdamW weight decay.
        grad_clip: global gradient-norm clip.
        save_every: steps between checkpoints (and between saved drafts).
        eval_every: steps between held-out evaluations (when evaluation data is given).
        bf16: autocast matrix products to bfloat16 (fp32 master weights).
        seed: seeds data order and initialisation.
        unroll: passes of a feature draft per batch, each fed the previous pass's states.
        state_weight: weight of a feature draft's hidden-state regression loss.
        objective: ``"kl"`` (cross-entropy against the top-k), ``"chi2"`` or ``"renyi2"``
            (the variance of SMC-SD's weights; ``objectives``).
        objective_temperature: T of both models in a weight objective.
        cut: the quality cut a ``chi2`` objective assumes (None: none).
        cut_divergence: the divergence that cut bounds.
    """

    kind: str = "layers"
    init_draft: str | None = None
    layers: int = 4
    source_layers: tuple[int, ...] | None = None
    steps: int = 1000
    batch_tokens: int = 4096
    lr: float = 5e-4
    warmup: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    save_every: int = 50
    eval_every: int = 100
    bf16: bool = True
    seed: int = 0
    unroll: int = 2
    state_weight: float = 0.5
    objective: str = "kl"
    objective_temperature: float = 1.0
    cut: float | None = Objective.cut
    cut_divergence: str = Objective.divergence

    def __post_init__(self) -> None:
        if self.kind not in ("layers", "features"):
            raise ValueError(f"kind must be 'layers' or 'features', got {self.kind!r}")
        _ = self.loss_objective  # refuses an unknown objective, temperature or cut
        for name in ("layers", "steps", "batch_tokens", "save_every", "eval_every", "unroll"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("lr", "grad_clip"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.warmup < 0 or self.weight_decay < 0 or self.state_weight < 0:
            raise ValueError("warmup, weight_decay and state_weight must be >= 0")

    @property
    def loss_objective(self) -> Objective:
        """The per-position loss these settings train on."""
        return Objective(self.objective, self.objective_temperature, self.cut, self.cut_divergence)

    def settings(self) -> dict:
        """The settings a checkpoint records; a KL run's leave out the weight objective's, as before it."""
        values = dataclasses.asdict(self)
        if self.objective == "kl":  # so that KL runs started before the weight objectives resume
            for name in _WEIGHT_OBJECTIVE_FIELDS:
                del values[name]
        return values


_WEIGHT_OBJECTIVE_FIELDS = ("objective", "objective_temperature", "cut", "cut_divergence")


@dataclass(frozen=True)
class Progress:
    """Where a run stands, passed to the progress callback after every step."""

    step: int
    steps: int
    tokens: int
    loss: float
    metrics: dict | None = None


def batches(examples: Sequence[Example], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches of example indices: shuffled, then grouped by similar length.

    A pure function of its arguments, so a resumed run sees the same batches.
    """
    order = list(range(len(examples)))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    out: list[list[int]] = []
    for first in range(0, len(order), 256):  # sort within windows: little padding, still random
        window = sorted(order[first : first + 256], key=lambda i: len(examples[i].ids))
        batch: list[int] = []
        for i in window:
            width = max([len(examples[j].ids) for j in batch] + [len(examples[i].ids)])
            if batch and width * (len(batch) + 1) > batch_tokens:
                out.append(batch)
                batch = []
            batch.append(i)
        if batch:
            out.append(batch)
    random.Random(seed * 100_003 + epoch + 1).shuffle(out)
    return out


def _schedule(config: DistillConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / (config.warmup + 1)
        progress = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def distill(
    target: LoadedModel,
    train: Sequence[Example],
    out_dir: str | os.PathLike,
    config: DistillConfig = DistillConfig(),
    *,
    held_out: Sequence[Example] = (),
    on_progress: Callable[[Progress], None] | None = None,
) -> pathlib.Path:
    """Train a draft for ``target`` on ``train``; resumes from ``out_dir``'s checkpoint.

    Args:
        target: the target (its embeddings and LM head are shared, never changed).
        train: examples from ``data.collect`` / ``data.corpus_examples``.
        out_dir: receives ``checkpoint.pt``, ``train_log.jsonl`` (loss; held-out agreement
            and acceptance against training tokens) and the draft in ``draft/``.
        config: settings; a resumed run must use the same ones.
        held_out: examples evaluated every ``eval_every`` steps (not trained on).
        on_progress: called after every step.

    Returns:
        The directory of the trained draft (loadable with ``drafts.load_draft``).
    """
    if not train:
        raise ValueError("no training examples")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = _setup(target, train, config, out)
    state = _resume(run)
    if held_out and state["step"] == 0:  # the starting point of the curve
        _append_log(out / LOG, {**state, **match_metrics(target.model, run.model.eval(), held_out)})
        run.model.train()
    epoch_batches = batches(train, config.batch_tokens, config.seed, state["epoch"])
    started = time.perf_counter() - state["seconds"]
    while state["step"] < config.steps:
        if state["index"] >= len(epoch_batches):
            state["epoch"], state["index"] = state["epoch"] + 1, 0
            epoch_batches = batches(train, config.batch_tokens, config.seed, state["epoch"])
        loss = _step(run, train, epoch_batches[state["index"]], state)
        state["seconds"] = time.perf_counter() - started
        metrics = _record(run, state, loss, held_out)
        if on_progress is not None:
            on_progress(Progress(state["step"], config.steps, state["tokens"], loss.item(), metrics))
    return out / DRAFT_SUBDIR


@dataclass
class _Run:
    """One distillation: the draft in training, its optimizer and schedule, what checkpoints record."""

    target: LoadedModel
    config: DistillConfig
    out: pathlib.Path
    manifest: dict  # the target, its fingerprint, the source layers and the settings
    model: torch.nn.Module
    params: list[torch.nn.Parameter]  # the trained ones (embeddings and LM head are shared, frozen)
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    states: list[torch.Tensor] | None  # a feature draft's target states, per training example
    autocast: bool


def _setup(target: LoadedModel, train: Sequence[Example], config: DistillConfig, out: pathlib.Path) -> _Run:
    """The draft, initialised from the target's layers (or a layer draft), and its optimizer."""
    total = target.model.config.num_hidden_layers
    if config.init_draft is None and config.source_layers is None and config.layers >= total:
        raise ValueError(f"a draft of {config.layers} layers is no smaller than the target ({total} layers)")
    init = _init_draft(config.init_draft, target) if config.init_draft else None
    if init is not None:
        sources = init["source_layers"]
    else:
        sources = list(config.source_layers or range(config.layers))
    manifest = {
        "target": target.name,
        "fingerprint": fingerprint(target.model),
        "source_layers": sources,
        "config": config.settings() | {"source_layers": sources},
    }
    if init is not None and init["training_prompts"]:  # what it learned from is no held-out data either
        manifest["training_prompts"] = init["training_prompts"]
    torch.manual_seed(config.seed)
    states = None
    if config.kind == "features":
        model = feature_student(target.model, sources).train()
        states = hidden_states(target, train, config.batch_tokens)
    else:
        model = student(target, sources).train()
    if init is not None:
        for name in ("layers", "norm"):
            draft_modules(model)[name].load_state_dict(init["modules"][name])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(config))
    autocast = config.bf16 and model.device.type in ("cpu", "cuda")
    return _Run(target, config, out, manifest, model, params, opt, sched, states, autocast)


def _resume(run: _Run) -> dict:
    """The run's counters: from its checkpoint (weights, optimizer, RNG restored) or from zero."""
    ckpt = run.out / CHECKPOINT
    if not ckpt.is_file():
        (run.out / LOG).unlink(missing_ok=True)  # no checkpoint: the run starts over
        return {"step": 0, "tokens": 0, "epoch": 0, "index": 0, "seconds": 0.0}
    saved = torch.load(ckpt, weights_only=False)
    if (
        saved["manifest"]["config"] != run.manifest["config"]
        or saved["manifest"]["fingerprint"] != run.manifest["fingerprint"]
    ):
        raise ValueError(f"{ckpt} was written with other settings or another target; use a new --out")
    try:
        for name, module in draft_modules(run.model).items():  # shared tensors aren't saved
            module.load_state_dict(saved["model"][name])
    except (KeyError, RuntimeError) as err:
        raise ValueError(f"{ckpt} does not match the draft's layers; use a new --out") from err
    run.opt.load_state_dict(saved["optimizer"])
    run.sched.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"])
    _truncate_log(run.out / LOG, saved["state"]["step"])
    return saved["state"]


def _step(run: _Run, train: Sequence[Example], indices: list[int], state: dict) -> torch.Tensor:
    """One optimizer step on the batch ``indices``; advances the counters; returns the loss."""
    config, group = run.config, [train[i] for i in indices]
    state["index"] += 1
    if config.kind == "features":
        loss, scored = feature_kd_loss(
            run.model,
            group,
            [run.states[i] for i in indices],
            autocast=run.autocast,
            unroll=config.unroll,
            state_weight=config.state_weight,
            objective=config.loss_objective,
        )
    else:
        loss, scored = kd_loss(run.model, group, autocast=run.autocast, objective=config.loss_objective)
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.params, config.grad_clip)
    run.opt.step()
    run.sched.step()
    state["step"] += 1
    state["tokens"] += scored
    return loss


def _record(run: _Run, state: dict, loss: torch.Tensor, held_out: Sequence[Example]) -> dict | None:
    """Evaluate, log and checkpoint when due after a step; returns the held-out metrics, if measured."""
    config, step = run.config, state["step"]
    last = step == config.steps
    metrics = None
    if held_out and (step % config.eval_every == 0 or last):
        run.model.eval()
        metrics = match_metrics(run.target.model, run.model, held_out)
        run.model.train()
    if metrics is not None or step % config.save_every == 0 or last:
        lr = run.sched.get_last_lr()[0]
        _append_log(run.out / LOG, {**state, "loss": loss.item(), "lr": lr, **(metrics or {})})
    if step % config.save_every == 0 or last:
        _checkpoint(run, state)
    return metrics


def _checkpoint(run: _Run, state: dict) -> None:
    """Save the draft, then atomically the checkpoint a resumed run continues from exactly."""
    trained = {"steps": state["step"], "tokens": state["tokens"], "seconds": state["seconds"]}
    save_draft(run.model, run.out / DRAFT_SUBDIR, run.manifest | {"trained": trained})
    saved = {
        "manifest": run.manifest,
        "model": {name: module.state_dict() for name, module in draft_modules(run.model).items()},
        "optimizer": run.opt.state_dict(),
        "scheduler": run.sched.state_dict(),
        "state": dict(state),
        "rng": torch.get_rng_state(),
    }
    ckpt = run.out / CHECKPOINT
    torch.save(saved, f"{ckpt}.tmp")
    os.replace(f"{ckpt}.tmp", ckpt)


def _init_draft(directory: str, target: LoadedModel) -> dict:
    """The source layers, trained tensors and training prompts of the layer draft a run starts from."""
    draft = load_draft(directory, target)
    if getattr(draft.model, "reads_hidden", False):
        raise ValueError(f"{directory!r} is a feature draft; init_draft takes a layer draft")
    manifest = json.loads((pathlib.Path(directory) / MANIFEST).read_text())
    modules = {
        name: {k: v.float() for k, v in m.state_dict().items()}
        for name, m in draft_modules(draft.model).items()
    }
    prompts = manifest.get("training_prompts", [])
    return {"source_layers": manifest["source_layers"], "modules": modules, "training_prompts": prompts}


def _append_log(path: pathlib.Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _truncate_log(path: pathlib.Path, step: int) -> None:
    """Drop log lines written after the checkpoint a run resumes from (they will be redone)."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]

    path.write_text("".join(f"{line}\n" for line in lines))
