"""``smcsd serve`` as a user runs it: one line saying where it serves, a clean stop, one-line errors."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

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


def test_a_port_in_use_gives_one_line_before_models_load():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        code, _out, err, _ = run_cli("serve", "--port", str(taken.getsockname()[1]))
    assert_one_line_error(code, err, "cannot listen on 127.0.0.1")
    assert "loading models" not in err


@pytest.mark.slow
def test_serve_prints_where_it_serves_answers_and_stops_on_ctrl_c():
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable,
        "-m",
        "smcsd_ppl",
        "serve",
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
        assert model == "HuggingFaceTB/SmolLM2-135M-Instruct"
        ask = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "seed": 1}
        out = httpx.post(f"{url}/chat/completions", json=ask, timeout=120).json()
        assert out["usage"]["completion_tokens"] <= 4 and out["choices"][0]["smcsd"]["seed"] == 1
    finally:
        server.send_signal(signal.SIGINT)
        _out, err = server.communicate(timeout=60)
    assert server.returncode == 0 and err.rstrip().endswith("stopped"), err
