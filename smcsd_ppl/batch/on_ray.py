"""``smcsd batch`` over a Ray cluster: prompt batches mapped over a pool of actors, one pair each.

The driver reads the output file, leaves out the prompts it already holds and hands the rest to
Ray Data's ``map_batches`` over a fixed pool of ``PairWorker`` actors; each actor loads one pair
and runs the prompts of each batch it is handed through ``PromptRunner`` as one batch, the code
the one-process batch runs, so a record is the same whichever actor ran it and however the
prompts were batched. The
driver alone writes the file, appending records as batches come back, so an interrupted run
resumes like a one-process one. Ray restarts an actor that dies and runs its batch again.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import SMCConfig
from .prompts import Prompt
from .records import check_prompt_texts, check_settings, existing_records
from .run import BATCH_KEY, WRITER, BatchSummary, OnRecord, PromptRunner, check_batch, collect

if TYPE_CHECKING:
    from ..api import SMCSD
    from ..potentials.spec import ConstraintSpec

RAY_HINT = "--ray needs Ray Data: pip install 'smcsd_ppl[ray]' (see docs/scaling.md)"
PROBE = ""  # a row without a prompt: the worker only reports its settings


class PairWorker:
    """A Ray Data actor: one pair, loaded once, and the batch's settings.

    Args:
        load: builds the pair (called once per actor, again after a restart).
        config: the batch's settings; ``config.seed`` is the base seed.
        method: a method name.
        constraint: the constraint every output satisfies, or None.
    """

    def __init__(
        self,
        load: Callable[[], SMCSD],
        config: SMCConfig,
        method: str,
        constraint: ConstraintSpec | None,
    ) -> None:
        self.runner = PromptRunner(load(), config, method, constraint)

    def __call__(self, batch: dict) -> dict:
        """The batch's records (JSON lines; one empty for a probe) and this worker's settings.

        The batch's prompts run on this worker's pair as one batch, as in one process.
        """
        prompts = [Prompt(**json.loads(row)) for row in batch["prompt"] if row != PROBE]
        records = [json.dumps(r) for r in self.runner.records(prompts)] or [""]
        return {"record": records, "settings": [json.dumps(self.runner.settings)] * len(records)}


@dataclass(frozen=True)
class RayPool:
    """The actors a batch runs on.

    Attributes:
        workers: actors, one pair each.
        gpus_per_worker: GPUs Ray reserves for each actor (its engines' tensor-parallel group).
        prompts_per_batch: prompts handed to an actor at a time, run there as one batch.
    """

    workers: int = 2
    gpus_per_worker: float = 0
    prompts_per_batch: int = 16

    def __post_init__(self) -> None:
        if self.workers < 1 or self.prompts_per_batch < 1:
            got = f"{self.workers}, {self.prompts_per_batch}"
            raise ValueError(f"workers and prompts per batch must be at least 1, got {got}")
        if self.gpus_per_worker < 0:
            raise ValueError(f"--gpus-per-worker must be at least 0, got {self.gpus_per_worker}")


def run_batch_on_ray(
    load: Callable[[], SMCSD],
    prompts: Sequence[Prompt],
    out_path: str | Path,
    config: SMCConfig | None = None,
    *,
    pool: RayPool,
    method: str = "smcsd",
    constraint: ConstraintSpec | None = None,
    on_record: OnRecord | None = None,
) -> BatchSummary:
    """``run_batch`` with the prompts spread over a pool of Ray actors, each holding a pair.

    Ray is started by the caller (``ray.init``), or here with Ray's defaults (``RAY_ADDRESS``
    if set, else a local cluster). The file's records, resume and checks are those of
    ``run_batch``; the settings are checked against the first worker's before anything is written.

    Args:
        load: builds the pair in each actor (a picklable callable, e.g. a partial of ``SMCSD.load``).
        prompts: from ``load_prompts`` (ids unique).
        out_path: the JSONL file (created, or resumed: its prompts are skipped).
        config: the settings; ``config.seed`` is the base seed each prompt's derives from.
        pool: the actors and how many prompts each is handed at a time.
        method: a method name (``"smcsd"`` under a constraint).
        constraint: the constraint every output satisfies, or None.
        on_record: called with (record, prompts done, prompts in all) after each.

    Raises:
        ValueError: as ``run_batch``; Ray Data not installed.
    """
    config = check_batch(prompts, config, method, constraint)
    out_path = Path(out_path)
    existing, good = existing_records(out_path, key_fields=BATCH_KEY, writer=WRITER)
    check_prompt_texts(existing, prompts)
    done = {r["prompt_id"]: r for r in existing}
    todo = [p for p in prompts if p.id not in done]
    rows = [json.dumps(dataclasses.asdict(p)) for p in todo] or [PROBE]
    results = _mapped(rows, (load, config, method, constraint), pool)
    return collect(out_path, good, prompts, done, _checked(results, existing), on_record)


def _mapped(rows: list[str], args: tuple, pool: RayPool) -> Iterator[dict]:
    """The workers' output rows, as batches come back (in any order)."""
    try:
        import ray.data
    except ImportError as err:
        raise ValueError(RAY_HINT) from err
    ray.data.DataContext.get_current().enable_progress_bars = False  # the caller shows its own
    per_batch = pool.prompts_per_batch
    blocks = -(-len(rows) // per_batch)  # a block per batch: the pool hands out blocks, not rows
    dataset = ray.data.from_items([{"prompt": r} for r in rows], override_num_blocks=blocks).map_batches(
        PairWorker,
        fn_constructor_args=args,
        batch_size=per_batch,
        # No more actors than batches: each loads a pair. Ray Data restarts an actor that dies
        # (killed, out of memory) and reruns its batch: actor pools default to unlimited retries.
        compute=ray.data.ActorPoolStrategy(size=min(pool.workers, blocks)),
        num_gpus=pool.gpus_per_worker,
    )
    yield from dataset.iter_rows()


def _checked(results: Iterator[dict], existing: list[dict]) -> Iterator[dict]:
    """The records of ``results``, once the first row's settings match the file's records."""
    checked = False
    for row in results:
        if not checked:
            check_settings(existing, json.loads(row["settings"]))
            checked = True
        if row["record"]:
            yield json.loads(row["record"])
