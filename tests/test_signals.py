"""A real signal to a real ``smcsd`` process: a clean exit (130 or 143), what was made kept, no abort.

The interpreter must not exit while the torch thread is inside a kernel, or the whole process
aborts ("terminate called without an active exception", SIGABRT). Only a separate process shows
that: ``main()`` called in-process never exits the interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow  # the embedded pair, loaded in a process of its own


def _start(args: list[str]) -> tuple[subprocess.Popen, list[bytes]]:
    """``python -m smcsd_ppl ARGS`` in a session of its own; its stdout, collected as it comes."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "smcsd_ppl", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    chunks: list[bytes] = []
    collect = lambda: chunks.extend(iter(lambda: proc.stdout.read1(64), b""))  # noqa: E731
    threading.Thread(target=collect, daemon=True).start()
    return proc, chunks


def _wait_for(ready, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "nothing came before the deadline"
        time.sleep(0.05)


def _ended(proc: subprocess.Popen) -> tuple[int, str]:
    proc.wait(timeout=60)
    return proc.returncode, proc.stderr.read().decode("utf-8", "replace")


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_generate_exits_cleanly_with_the_settled_text(sig, status):
    proc, chunks = _start(["generate", "--max-new-tokens", "400", "Write a long story about a dragon."])
    _wait_for(lambda: len(b"".join(chunks)) >= 40, proc)  # text is streaming: the models run
    proc.send_signal(sig)
    code, err = _ended(proc)
    assert code == status, err
    assert "terminate called" not in err and "Traceback" not in err, err
    settled = int(err.split("interrupted after ")[1].split()[0])
    text = b"".join(chunks).decode()
    assert settled > 0 and len(text.strip()) >= 40
    assert text.endswith("\n"), "the line break after the kept text is the last thing written"


def test_ctrl_c_to_a_batch_s_process_group_keeps_the_finished_records(tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    lines = (json.dumps({"prompt": f"Write story {i} about a dragon."}) for i in range(8))
    prompts.write_text("".join(line + "\n" for line in lines))
    proc, _ = _start(["batch", str(prompts), "--out", str(out), "--max-new-tokens", "120", "--alone"])
    _wait_for(lambda: out.exists() and out.read_text().count("\n") >= 1, proc)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches every process of the group
    code, err = _ended(proc)
    assert code == 130, err
    assert "terminate called" not in err and "Traceback" not in err, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert 1 <= len(records) < 8 and all(r["text"] for r in records)
    assert f"interrupted after {len(records)}/8 prompts" in err
