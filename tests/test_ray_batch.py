"""``smcsd batch --ray``: prompts over a pool of Ray actors give the one-process run's records.

On a local Ray cluster started here (2 CPUs), each actor loading the real embedded pair in
float32: an actor runs its share of the prompts as one batch, of other shapes than the
one-process run's, which in float32 leaves every token as it was. Skipped where Ray Data is
not installed (``pip install '.[ray]'``; CI installs it).
"""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from smcsd_ppl.api import SMCSD  # noqa: E402
from smcsd_ppl.batch import load_prompts  # noqa: E402
from smcsd_ppl.batch.on_ray import RayPool, run_batch_on_ray  # noqa: E402
from smcsd_ppl.cli import main  # noqa: E402
from smcsd_ppl.config import SMCConfig  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[1]
POOL = RayPool(workers=2, prompts_per_batch=1)
TEXTS = ["The quick brown fox", "Once upon a time", "Name a color.", "Rain falls", "Say hi.", "The sun"]
SETTINGS = ["-n", "2", "-k", "2", "--max-new-tokens", "4", "--threads", "1", "--dtype", "float32"]
CONFIG = SMCConfig(n_particles=2, block_size=2, max_new_tokens=4)
TIMINGS = ("seconds", "tokens_per_second", "overhead_fraction")


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster whose workers import this checkout's package (as the driver does)."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ray") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(TEXTS)))
    return path


@pytest.fixture(scope="module")
def one_process(prompts_file, tmp_path_factory) -> dict:
    """The records of the one-process ``smcsd batch``, by prompt id."""
    out = tmp_path_factory.mktemp("one") / "one.jsonl"
    assert main(["batch", str(prompts_file), "--out", str(out), *SETTINGS]) == 0
    return outputs(out)


def outputs(path: Path) -> dict:
    """Every field of every record but the timings, by prompt id (and no prompt twice)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {r["prompt_id"]: {k: v for k, v in r.items() if k not in TIMINGS} for r in records}
    assert len(by_id) == len(records)
    return by_id


def assert_same(got: dict, want: dict) -> None:
    """The same records: every token and count equal; floats (log Z, ESS) to float32's rounding,
    which other batch shapes move in the sixth digit."""
    assert got.keys() == want.keys()
    for pid, record in want.items():
        assert got[pid].keys() == record.keys(), pid
        for field, value in record.items():
            if isinstance(value, float):
                assert got[pid][field] == pytest.approx(value, rel=1e-4, abs=1e-5), (pid, field)
            else:
                assert got[pid][field] == value, (pid, field)


def test_two_workers_write_the_one_process_records(cluster, prompts_file, one_process, tmp_path):
    out = tmp_path / "ray.jsonl"
    argv = ["batch", str(prompts_file), "--out", str(out), *SETTINGS, "--ray", "--workers", "2"]
    assert main([*argv, "--prompts-per-batch", "2"]) == 0
    assert_same(outputs(out), one_process)
    assert len({r["seed"] for r in one_process.values()}) == len(TEXTS)
    # Rerun: everything resumed (the settings still checked, by a worker), nothing written twice.
    assert main(argv) == 0
    assert_same(outputs(out), one_process)
    # Other settings: refused in one line before anything is written.
    size = out.stat().st_size
    assert main([*argv, "--seed", "1"]) == 2
    assert out.stat().st_size == size


def test_a_killed_worker_and_an_interrupted_driver_lose_nothing(cluster, prompts_file, one_process, tmp_path):
    prompts = load_prompts(str(prompts_file))
    out = tmp_path / "ray.jsonl"
    load = functools.partial(SMCSD.load, threads=1, dtype="float32")
    killed = []

    def kill_a_worker_then_stop(_record, done, _total):
        if done == 1:  # mid-run: the other prompts are queued or running on the actors
            killed.append(_kill_one_actor())
        if done == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_batch_on_ray(load, prompts, out, CONFIG, pool=POOL, on_record=kill_a_worker_then_stop)
    assert killed and len(out.read_text().splitlines()) == 4  # Ray restarted the actor and reran its batch
    summary = run_batch_on_ray(load, prompts, out, CONFIG, pool=POOL)
    assert summary.resumed == 4 and len(summary.records) == len(TEXTS)
    assert_same(outputs(out), one_process)


def _kill_one_actor() -> int:
    """SIGKILL one of the pool's actor processes (Ray names them ``ray::MapWorker(...)``); its pid."""
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(b"ray::MapWorker"):
            os.kill(pid, signal.SIGKILL)
            return pid
    raise AssertionError("no actor process found")
