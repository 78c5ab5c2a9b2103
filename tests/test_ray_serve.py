"""``smcsd serve --ray``: two Ray Serve replicas answer as the single-process server does.

Runs where Ray Serve is installed (``.ci/run`` installs ``.[ray]``); skipped elsewhere. A
local cluster is started by the test. Both servers run the embedded pair in float32, so
the batches a request shares leave its tokens as they are alone.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install '.[ray]')")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from smcsd_ppl.cli import build_parser, serve_ray  # noqa: E402
from smcsd_ppl.cli.loading import load_pair  # noqa: E402
from smcsd_ppl.cli.serve import serve_settings  # noqa: E402
from smcsd_ppl.serving.server import BackgroundServer  # noqa: E402
from smcsd_ppl.serving.settings import build_server  # noqa: E402

REQUESTS = 16
SETTINGS = [
    "--model-name",
    "smcsd",
    "--dtype",
    "float32",
    "--threads",
    "1",
    "--max-new-tokens",
    "8",
    "--particles",
    "4",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(url: str, i: int) -> dict:
    body = {
        "model": "smcsd",
        "prompt": f"Name an animal whose name starts with {'ABCDEFGHIJKLMNOP'[i]}.",
        "seed": i,
    }
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return {"seed": choice["smcsd"]["seed"], "text": choice["text"]}


def answers(url: str) -> list[dict]:
    with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
        return list(pool.map(lambda i: ask(url, i), range(REQUESTS)))


@pytest.fixture(scope="module")
def single_process_answers():
    args = build_parser().parse_args(["serve", *SETTINGS])
    pair = load_pair(args)
    with BackgroundServer(build_server(serve_settings(args, core="thread"), pair)) as server:
        return answers(server.url)


def test_two_replicas_answer_each_request_once_as_one_process_does(single_process_answers):
    port = free_port()
    args = build_parser().parse_args(["serve", "--ray", "--replicas", "2", "--port", str(port), *SETTINGS])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        url = serve_ray.start(args, serve_settings(args, core="thread"))
        replicas = serve.status().applications["smcsd"].deployments["smcsd"].replica_states
        assert replicas.get("RUNNING") == 2, replicas
        got = answers(url)
    finally:
        serve.shutdown()
        ray.shutdown()
    assert sorted(a["seed"] for a in got) == list(range(REQUESTS))  # each request answered, once
    assert got == single_process_answers
