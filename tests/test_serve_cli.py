"""``smcsd serve`` as a user runs it: one line saying where it serves, a clean stop, one-line errors."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import ROOT, assert_one_line_error, run_cli


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--port", "70000"], "--port"),
        (["--max-queue", "0"], "--max-queue"),
        (["--max-rows", "0"], "--max-rows"),
        (["--api-key", " "], "--api-key"),
    ],
)
def test_bad_server_options_give_one_line(args, needle):
    code, _out, err, _ = run_cli("serve", *args)
    assert_one_line_error(code, err, needle)


def test_a_model_named_twice_gives_one_line():
    code, _out, err, _ = run_cli("serve", TARGET, "--target", "other/model")
    assert_one_line_error(code, err, "name two targets")


def test_a_port_in_use_gives_one_line_before_models_load():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        code, _out, err, _ = run_cli("serve", "--port", str(taken.getsockname()[1]))
    assert_one_line_error(code, err, "cannot listen on 127.0.0.1")
    assert "loading models" not in err


TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.slow
@pytest.mark.parametrize("named", [[], [TARGET], ["--model", TARGET]], ids=["default", "MODEL", "--model"])
def test_serve_prints_where_it_serves_answers_and_stops_on_ctrl_c(named):
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable,
        "-m",
        "smcsd_ppl",
        "serve",
        *named,
        "--port",
        "0",
        "--threads",
        "1",
        "--max-new-tokens",
        "4",
    ]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True
    )
    try:
        line = server.stdout.readline()
        found = re.fullmatch(
            r"serving (\S+) at (http://127\.0\.0\.1:\d+/v1) \(OpenAI API; Ctrl-C stops\)\n", line
        )
        assert found, line + server.stderr.read()
        model, url = found.groups()
        assert model == TARGET
        ask = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "seed": 1}
        out = httpx.post(f"{url}/chat/completions", json=ask, timeout=120).json()
        assert out["usage"]["completion_tokens"] <= 4 and out["choices"][0]["smcsd"]["seed"] == 1
    finally:
        server.send_signal(signal.SIGINT)
        _out, err = server.communicate(timeout=60)
    assert server.returncode == 0 and err.rstrip().endswith("stopped"), err


def _gauge(url: str, name: str) -> float:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    found = re.search(rf"^smcsd_{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else -1.0


def _streamed(url: str, body: dict, started: threading.Event) -> tuple[str, str | None]:
    """A streamed completion's whole text and finish reason; ``started`` is set at its first text."""
    text, reason = "", None
    with httpx.stream("POST", f"{url}/completions", json=body | {"stream": True}, timeout=300) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            text += choice["text"]
            reason = choice.get("finish_reason") or reason
            if text:
                started.set()
    return text, reason


@pytest.mark.slow
def test_sigterm_drains_eight_running_requests_and_exits_0():
    """New requests get 503; the eight running end with their text and a finish reason; exit 0."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "smcsd_ppl", "serve", "--port", "0", "--dtype", "float32"]
    command += ["--particles", "2", "--max-new-tokens", "300", "--grace-seconds", "2"]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True
    )
    try:
        url = re.search(r"at (http://\S+/v1)", server.stdout.readline()).group(1)
        ask = {"prompt": "Tell a long story about a dragon.", "max_tokens": 300, "ignore_eos": True}
        # Streamed, so the signal waits for every request's first text: exact streaming sends a
        # token only once the particles agree on it, and how soon that is depends on the machine.
        started = [threading.Event() for _ in range(8)]
        with ThreadPoolExecutor(8) as pool:
            replies = [pool.submit(_streamed, url, ask | {"seed": i}, started[i]) for i in range(8)]
            assert all(e.wait(120) for e in started)
            assert _gauge(url, "requests_running") == 8
            server.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            late = httpx.post(f"{url}/completions", json=ask, timeout=60)
            assert late.status_code == 503, late.text
            answers = [r.result() for r in replies]
        _out, err = server.communicate(timeout=120)
    finally:
        server.kill()
    assert server.returncode == 0, err
    assert all(text and reason in ("length", "abort") for text, reason in answers), answers
    assert any(reason == "abort" for _, reason in answers)  # 300 tokens take longer than the grace


def _events(url: str, body: dict, started: threading.Event) -> list[dict]:
    """A streamed completion's events; ``started`` is set at its first text."""
    events = []
    with httpx.stream("POST", f"{url}/completions", json=body | {"stream": True}, timeout=300) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line.removeprefix("data: ")))
                if events[-1].get("choices") and events[-1]["choices"][0]["text"]:
                    started.set()
    return events


def _health(url: str) -> int | None:
    """``/health``'s status, None once the server no longer listens."""
    try:
        return httpx.get(url, timeout=10).status_code
    except httpx.ConnectError:
        return None


def _engine_pid(server_pid: int) -> int:
    """The engine process among the server's children (not multiprocessing's resource tracker)."""
    children = []
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return pid
    raise AssertionError(f"no engine process among {children}")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="finds the engine through /proc")
def test_a_killed_engine_turns_health_to_503_at_once_and_the_server_exits_1():
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "smcsd_ppl", "serve", "--port", "0", "--grace-seconds", "30"]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True
    )
    try:
        url = re.search(r"at (http://\S+/v1)", server.stdout.readline()).group(1)
        health = url.removesuffix("/v1") + "/health"
        assert httpx.get(health, timeout=10).status_code == 200
        ask = {"prompt": "Tell a long story about a dragon.", "max_tokens": 300, "ignore_eos": True}
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_events, url, ask, started)
            assert started.wait(120)
            os.kill(_engine_pid(server.pid), signal.SIGKILL)  # as the OOM killer does
            killed = time.monotonic()
            while _health(health) == 200:  # then 503 engine_dead (tests/test_engine_process.py), or gone
                assert time.monotonic() - killed < 1.0, "/health still says ok a second after"
                time.sleep(0.02)
            events = running.result(timeout=30)
            assert "engine process ended" in events[-1]["error"]["message"]  # told at once, in the stream
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
        _out, err = server.communicate(timeout=60)
    assert server.returncode == 1, err
    assert "the engine process ended (killed by signal 9)" in err and "Traceback" not in err, err
