"""The HTTP server against a live uvicorn on localhost: every endpoint, streaming, errors, disconnects.

The tiny random pair serves most tests (fast; only structure is judged on it); the embedded pair
serves the chat template and the official ``openai`` client.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import tiny
import torch

from smcsd_ppl.api import SMCSD
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.engine.client import Engine, EngineClosed, EngineStats, ServeRequest
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.serving.app import DISCONNECT_POLL_SECONDS, build_app
from smcsd_ppl.serving.schema import ChatCompletion, Completion
from smcsd_ppl.serving.server import BackgroundServer
from smcsd_ppl.serving.unhonoured import UNSUPPORTED

pytestmark = pytest.mark.usefixtures("one_thread")

DEFAULTS = SMCConfig(
    n_particles=4, block_size=3, max_new_tokens=6, draft_temperature=1.0, target_temperature=1.0
)
# Outputs of exactly max_tokens (EOS ignored, for every request alike): long enough to cut off.
UNENDING = dataclasses.replace(DEFAULTS, ignore_eos=True)
MODEL = "tiny"


@contextlib.contextmanager
def served(pair, *, defaults=DEFAULTS, max_queue=16, max_rows=512, **app_options):
    """A live server of ``pair`` on a free port; yields an httpx client on it."""
    with owned(pair, defaults, max_queue=max_queue, max_rows=max_rows) as engine:
        name = app_options.pop("model_name", MODEL)
        app = build_app(engine, model_name=name, defaults=defaults, **app_options)
        with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=120) as client:
            yield client


@contextlib.contextmanager
def owned(pair, defaults, **limits):
    """An engine made the pair's own, as ``smcsd serve`` makes it; after, the pair starts a new one."""
    engine = Engine(pair.core, defaults, **limits)
    pair.use_engine(engine)
    try:
        yield engine
    finally:
        pair.close()


@pytest.fixture(scope="module")
def tiny_server(tiny_smcsd):
    with served(tiny_smcsd) as client:
        yield client


def gauge(client, name: str) -> float:
    """One sample of ``/metrics`` (a metric without labels)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def counter(client, name: str, label: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{{label}}} "):
            return float(line.split()[1])
    raise AssertionError(f"{name}{{{label}}} not in /metrics")


def wait_idle(client, seconds: float = 30) -> None:
    """Until no row is in use and nothing waits (a cancelled request frees its rows at a cycle boundary)."""
    deadline = time.monotonic() + seconds
    while gauge(client, "smcsd_rows_in_use") or gauge(client, "smcsd_queue_depth"):
        assert time.monotonic() < deadline, client.get("/metrics").text
        time.sleep(0.05)


def sse(response) -> list:
    """The JSON events of a streamed response, and checks that it ends with [DONE]."""
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert all(line.startswith("data: ") for line in lines)
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_health_models_and_metrics(tiny_server):
    assert tiny_server.get("/health").json()["status"] == "ok"
    [card] = tiny_server.get("/v1/models").json()["data"]
    assert card["id"] == MODEL and card["object"] == "model"
    assert tiny_server.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    text = tiny_server.get("/metrics").text
    for name in (
        "smcsd_requests_total",
        "smcsd_queue_depth",
        "smcsd_rows_in_use",
        "smcsd_tokens_total",
        "smcsd_tokens_per_second",
        "smcsd_last_cycle_seconds",
        "smcsd_mean_ess",
    ):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def test_an_idle_server_holds_no_kv_cache(tiny_server):
    for body in (CHAT | {"n_particles": 4, "max_tokens": 8}, CHAT):
        assert tiny_server.post("/v1/chat/completions", json=body).status_code == 200
        wait_idle(tiny_server)
        assert gauge(tiny_server, "smcsd_kv_cache_bytes") == 0


def test_openapi_lists_the_smcsd_fields_and_types_are_checked_by_the_models(tiny_server):
    spec = tiny_server.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"], schemas["CompletionRequest"]
    smcsd = {"n_particles", "block_size", "twist", "proposal", "draft_temperature", "regex", "grammar"}
    assert smcsd | {"seed", "n", "stop", "response_format", "logprobs", "top_logprobs"} <= set(
        chat["properties"]
    )
    assert smcsd | {"prompt", "logprobs"} <= set(completion["properties"])
    assert tiny_server.get("/docs").status_code == 200
    assert spec["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]  # the answer's model
    answers = [  # what the server sends is what its response models say
        (Completion, tiny_server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "n": 2})),
        (ChatCompletion, tiny_server.post("/v1/chat/completions", json=CHAT | {"logprobs": True})),
    ]
    for model, reply in answers:
        model.model_validate(reply.json())
    for field, value in [("n", "2"), ("block_size", 2.5), ("stream", "yes"), ("seed", True)]:
        reply = tiny_server.post("/v1/completions", json={"prompt": "Hi", field: value})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == field and error["code"] == "invalid_type", error
        assert error["type"] == "invalid_request_error" and error["message"].startswith(f"{field}: ")


def test_an_unknown_field_is_refused_by_name(tiny_server):
    for stream in (False, True):
        ask = {"prompt": "Hi", "max_tokens": 2, "priority": 0, "stream": stream}
        error = error_of(tiny_server.post("/v1/completions", json=ask), 400)
        assert error["param"] == "priority" and "not a field this server knows" in error["message"]


# A value of each field the server honours (besides model, prompt or messages), by endpoint.
HONOURED = {
    "max_tokens": 3,
    "echo": True,
    "prompt_logprobs": 1,
    "max_completion_tokens": 3,
    "temperature": 0.7,
    "seed": 5,
    "n": 2,
    "stop": ["zz"],
    "stream": False,
    "stream_options": {"include_usage": True},
    "response_format": {"type": "text"},
    "user": "u",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "n_particles": 2,
    "block_size": 2,
    "draft_temperature": 0.5,
    "ignore_eos": True,
    "proposal": "draft",
    "twist": "off",
    "method": "ar",
    "return_tokens_as_token_ids": True,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.1,
    "logit_bias": {"5": 3},
}
# A value that uses each refused field (its unused values are accepted).
USED = {
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "repetition_penalty": 1.2,
    "min_tokens": 2,
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "suffix": "x",
    "best_of": 2,
    "audio": {"voice": "x"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "store": True,
    "metadata": {"a": "b"},
    "service_tier": "flex",
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "guided_json": {"type": "object"},
    "guided_regex": "a",
    "guided_grammar": "start: a",
    "guided_choice": ["a"],
}


def test_every_field_the_protocol_knows_is_honoured_or_refused_by_name(tiny_server):
    assert set(USED) == set(UNSUPPORTED)  # every refused field is tried here
    for field, value in HONOURED.items():
        reply = tiny_server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, field: value})
        assert reply.status_code == 200, (field, reply.text)
    for field, value in USED.items():
        error = error_of(tiny_server.post("/v1/completions", json={"prompt": "Hi", field: value}), 400)
        assert error["param"] == field and field in error["message"], error
        for unused in UNSUPPORTED[field]:
            ask = {"prompt": "Hi", "max_tokens": 2, field: unused}
            assert tiny_server.post("/v1/completions", json=ask).status_code == 200, (field, unused)


def test_a_completion_carries_text_usage_and_smc_diagnostics(tiny_server):
    body = tiny_server.post(
        "/v1/completions", json={"model": MODEL, "prompt": "The quick brown", "seed": 7}
    ).json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    [choice] = body["choices"]
    assert choice["finish_reason"] in ("stop", "length") and isinstance(choice["text"], str)
    smc = choice["smcsd"]
    assert smc["seed"] == 7 and smc["n_particles"] == 4 and smc["block_size"] == 3 and smc["twist"] is None
    assert {"log_z", "mean_ess", "n_resamples", "tokens_per_target_call"} <= set(smc)
    usage = body["usage"]
    assert (
        usage["completion_tokens"] <= 6
        and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )


@pytest.mark.parametrize("twist", ["structure", "lookahead"])
def test_a_constrained_completion_reports_its_twist(tiny_server, twist):
    ask = {"model": MODEL, "prompt": "The quick brown", "seed": 7, "regex": "(yes|no)", "twist": twist}
    response = tiny_server.post("/v1/completions", json=ask)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["text"] in ("yes", "no") and choice["smcsd"]["twist"] == twist


@pytest.mark.parametrize(
    ("asked", "ran"),
    [
        ({}, "finite"),
        ({"twist": "off"}, None),
        ({"twist": None}, None),
        ({"twist": "structure"}, "structure"),
    ],
)
def test_a_json_schema_runs_the_finite_twist_unless_the_request_names_one(tiny_server, asked, ran):
    schema = {"type": "json_schema", "json_schema": {"name": "yn", "schema": {"enum": ["yes", "no"]}}}
    ask = {"model": MODEL, "prompt": "The quick brown", "seed": 7, "response_format": schema} | asked
    response = tiny_server.post("/v1/completions", json=ask)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["text"] in ('"yes"', '"no"') and choice["smcsd"]["twist"] == ran
    # A regex keeps the server's default: no twist.
    regex = tiny_server.post("/v1/completions", json={"prompt": "The quick brown", "regex": "(yes|no)"})
    assert regex.json()["choices"][0]["smcsd"]["twist"] is None


def test_a_request_drafts_the_block_size_it_asks_for(tiny_server, monkeypatch):
    """Above the server's block size too: the response reports what ran, so it must be what ran."""
    import smcsd_ppl.inference.cycle as cycle_module

    widths, draft_blocks = [], cycle_module.draft_blocks

    def spy(store, requests, **kw):
        widths.append(kw["block_size"])
        return draft_blocks(store, requests, **kw)

    monkeypatch.setattr(cycle_module, "draft_blocks", spy)
    ask = {"model": MODEL, "prompt": "The quick brown", "seed": 7}  # sharing every batch-wide setting
    for k in (6, 2):
        widths.clear()
        body = tiny_server.post("/v1/completions", json=ask | {"block_size": k}).json()
        assert body["choices"][0]["smcsd"]["block_size"] == k
        assert widths and set(widths) == {k}, (k, widths)


def test_the_same_seed_gives_the_same_text_and_n_derives_seeds_from_it(tiny_server):
    ask = {"prompt": "Once upon a time", "seed": 11, "max_tokens": 5}
    one = tiny_server.post("/v1/completions", json=ask).json()
    again = tiny_server.post("/v1/completions", json=ask).json()
    three = tiny_server.post("/v1/completions", json=ask | {"n": 3}).json()
    assert one["choices"][0]["text"] == again["choices"][0]["text"] == three["choices"][0]["text"]
    seeds = [c["smcsd"]["seed"] for c in three["choices"]]
    assert [c["index"] for c in three["choices"]] == [0, 1, 2] and seeds[0] == 11 and len(set(seeds)) == 3
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt counts once


def test_the_concatenated_stream_is_the_non_streamed_text(tiny_server):
    ask = {"prompt": "The sun rises", "seed": 5, "max_tokens": 12, "n": 2}
    whole = tiny_server.post("/v1/completions", json=ask).json()
    with tiny_server.stream("POST", "/v1/completions", json=ask | {"stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse(response)
    assert all(e["object"] == "text_completion" for e in events)
    for choice in whole["choices"]:
        mine = [c for e in events for c in e["choices"] if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        assert mine[-1]["smcsd"]["seed"] == choice["smcsd"]["seed"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
    assert events[-1]["usage"] == whole["usage"]  # usage rides on the last chunk


def test_include_usage_sends_usage_in_a_chunk_of_its_own(tiny_server):
    ask = {"prompt": "Rain falls", "seed": 2, "stream": True, "stream_options": {"include_usage": True}}
    with tiny_server.stream("POST", "/v1/completions", json=ask) as response:
        events = sse(response)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] >= 1
    assert all("usage" not in e for e in events[:-1])


def test_a_stop_string_ends_the_output_before_it(tiny_server):
    ask = {"prompt": "The quick brown fox", "seed": 3, "max_tokens": 12}
    text = tiny_server.post("/v1/completions", json=ask).json()["choices"][0]["text"]
    if len(text) < 3:
        pytest.skip("too short an output to cut")
    stop = text[2:4]
    cut = tiny_server.post("/v1/completions", json=ask | {"stop": [stop]}).json()["choices"][0]
    assert cut["text"] == text[: text.index(stop)] and cut["finish_reason"] == "stop"


def test_a_stop_string_ends_the_tokens_usage_and_logprobs_where_the_text_ends(tiny_smcsd, tiny_server):
    ask = {"prompt": "The quick brown fox", "seed": 3, "max_tokens": 12, "logprobs": 1}
    ask |= {"return_tokens_as_token_ids": True}
    whole = tiny_server.post("/v1/completions", json=ask).json()["choices"][0]
    ids = ids_of(whole["logprobs"]["tokens"])
    if len(ids) < 4:
        pytest.skip("too short an output to cut")
    kept = ids[:2]  # a stop string starting where the third token's text starts
    stop = whole["text"][len(tiny_smcsd.decode(kept)) :][:2]
    reply = tiny_server.post("/v1/completions", json=ask | {"stop": [stop]}).json()
    cut = reply["choices"][0]
    assert cut["text"] == tiny_smcsd.decode(kept) and cut["finish_reason"] == "stop"
    assert ids_of(cut["logprobs"]["tokens"]) == kept and len(cut["logprobs"]["token_logprobs"]) == 2
    assert reply["usage"]["completion_tokens"] == 2


def plain_logprobs(model, prompt_ids, out_ids, temperature: float) -> torch.Tensor:
    """The target's log-probabilities at each output position, from one plain forward."""
    ids = torch.tensor([list(prompt_ids) + list(out_ids)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1)


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_clients_default_logprobs_fields_are_accepted(tiny_server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "seed": 1}
    for off in ({"logprobs": False}, {"logprobs": False, "top_logprobs": 0}, {"logprobs": None}):
        reply = tiny_server.post("/v1/chat/completions", json=chat | off)
        assert reply.status_code == 200 and reply.json()["choices"][0]["logprobs"] is None, off
    reply = tiny_server.post("/v1/chat/completions", json=chat | {"top_logprobs": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_logprobs"
    reply = tiny_server.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "logprobs": 21})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_target_s_at_its_temperature(tiny_smcsd, tiny_server, stream):
    prompt = [5, 9, 13, 2]
    ask = {"model": MODEL, "prompt": prompt, "seed": 4, "temperature": 0.7, "logprobs": 3, "stream": stream}
    reply = tiny_server.post("/v1/completions", json=ask | {"return_tokens_as_token_ids": True})
    if stream:
        chunks = [json.loads(x[6:]) for x in reply.text.splitlines() if x.startswith("data: {")]
        [scores] = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    else:
        scores = reply.json()["choices"][0]["logprobs"]
    out = ids_of(scores["tokens"])
    assert out and len(scores["token_logprobs"]) == len(out) == len(scores["top_logprobs"])
    expected = plain_logprobs(tiny_smcsd.target.model, prompt, out, 0.7)
    chosen = expected.gather(1, torch.tensor(out)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(scores["token_logprobs"]), chosen, atol=1e-4)
    for row, top in zip(expected, scores["top_logprobs"]):
        best = row.topk(3)
        assert dict(zip(ids_of(list(top)), top.values())) == pytest.approx(
            dict(zip(best.indices.tolist(), best.values.tolist())), abs=1e-4
        )


def test_a_regex_constrains_the_output(tiny_server):
    ask = {"prompt": "The capital of France is", "seed": 1, "max_tokens": 8, "regex": "(Paris|Rome)\\."}
    choice = tiny_server.post("/v1/completions", json=ask).json()["choices"][0]
    assert choice["text"] in ("Paris.", "Rome."), choice


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("temperature", -1, "temperature"),
        ("n_particles", 0, "n_particles"),
        ("block_size", "8", "block_size"),
        ("max_tokens", -1, "max_tokens"),
        ("top_p", 1.5, "top_p"),
        ("stop", ["a", "b", "c", "d", "e"], "stop"),
        ("method", "beam", "method"),
        ("n", 0, "n"),
    ],
)
def test_invalid_settings_get_400_naming_the_field(tiny_server, field, value, param):
    error = error_of(tiny_server.post("/v1/completions", json={"prompt": "Hi", field: value}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_a_body_that_is_not_a_json_object_gets_400(tiny_server):
    error_of(tiny_server.post("/v1/completions", content=b"{not json"), 400)
    error_of(tiny_server.post("/v1/completions", json=[1, 2]), 400)


def test_unknown_models_and_routes_get_404(tiny_server):
    assert (
        error_of(tiny_server.post("/v1/completions", json={"model": "gpt-9", "prompt": "Hi"}), 404)["code"]
        == "model_not_found"
    )
    error_of(tiny_server.get("/v1/models/gpt-9"), 404)
    error_of(tiny_server.post("/v1/nothing", json={}), 404)


def test_an_invalid_schema_gets_422_and_others_still_finish(tiny_server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    error = error_of(tiny_server.post("/v1/completions", json={"prompt": "Hi", "response_format": bad}), 422)
    assert error["param"] == "response_format"
    assert tiny_server.post("/v1/completions", json={"prompt": "Hi", "seed": 1}).status_code == 200


def test_a_prompt_past_the_context_gets_400(tiny_server):
    long_prompt = [5] * 200  # the tiny models hold 128 positions
    error_of(tiny_server.post("/v1/completions", json={"prompt": long_prompt}), 400)
    error_of(tiny_server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 500}), 400)
    wait_idle(tiny_server)


def test_a_client_gone_mid_stream_is_cancelled_and_its_rows_freed(tiny_smcsd):
    with served(tiny_smcsd, defaults=UNENDING) as client:
        # one token a cycle for 110 cycles: long enough to leave in the middle
        ask = {
            "prompt": "Once",
            "seed": 4,
            "max_tokens": 110,
            "block_size": 1,
            "n_particles": 16,
            "stream": True,
        }
        with client.stream("POST", "/v1/completions", json=ask) as response:
            lines = response.iter_lines()
            next(line for line in lines if '"text": "' in line and '"text": ""' not in line)
        # the client has closed the connection mid-stream
        deadline = time.monotonic() + 30
        while counter(client, "smcsd_requests_total", 'outcome="cancelled"') < 1:
            assert time.monotonic() < deadline, "the request was not cancelled"
            time.sleep(0.05)
        wait_idle(client)
        # a client that gives up waiting for a whole answer is cancelled too. Its request is held
        # in the queue (the engine is taken) until the client has left, so that it cannot
        # finish first on a fast machine, nor the client leave before the server read it.
        body = json.dumps(ask | {"stream": False}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\n\r\n"
        with tiny_smcsd.engine.exclusive():
            with socket.create_connection((client.base_url.host, client.base_url.port)) as sock:
                sock.sendall(head.encode() + body)
                deadline = time.monotonic() + 30
                while gauge(client, "smcsd_queue_depth") < 1:
                    assert time.monotonic() < deadline, "the waiting request never reached the queue"
                    time.sleep(0.01)
            time.sleep(8 * DISCONNECT_POLL_SECONDS)  # the server notices the client has gone
        deadline = time.monotonic() + 30
        while counter(client, "smcsd_requests_total", 'outcome="cancelled"') < 2:
            assert time.monotonic() < deadline, "the waiting request was not cancelled"
            time.sleep(0.05)
        wait_idle(client)
        assert counter(client, "smcsd_requests_total", 'outcome="completed"') == 0
        assert client.post("/v1/completions", json={"prompt": "Hi", "seed": 1}).status_code == 200


def test_api_key_body_size_full_queue_and_shutdown(tiny_smcsd):
    limits = dict(max_body_bytes=2000, max_queue=1, max_rows=4)  # rows for one request, one more may wait
    with served(tiny_smcsd, defaults=UNENDING, api_key="sesame", **limits) as client:
        assert (
            error_of(client.post("/v1/completions", json={"prompt": "Hi"}), 401)["code"] == "invalid_api_key"
        )
        wrong = {"Authorization": "Bearer open"}
        error_of(client.get("/v1/models", headers=wrong), 401)
        key = {"Authorization": "Bearer sesame"}
        assert client.get("/v1/models", headers=key).status_code == 200
        assert client.get("/health").status_code == 200  # health and metrics stay open
        error_of(client.post("/v1/completions", json={"prompt": "x" * 3000}, headers=key), 413)
        # rows for one, one slot in the queue: of many at once, some are refused, the rest finish
        ask = {"prompt": "The sun", "max_tokens": 40}
        codes, waits = [], []

        def call():
            reply = client.post("/v1/completions", json=ask, headers=key)
            codes.append(reply.status_code)
            if reply.status_code == 429:
                waits.append(reply.headers.get("retry-after"))

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
        assert waits and all(1 <= int(w) <= 60 for w in waits), waits  # a refusal says when to come back
        assert counter(client, "smcsd_requests_total", 'outcome="rejected"') >= codes.count(429)
        wait_idle(client)
    # after shutdown the engine refuses work
    with owned(tiny_smcsd, DEFAULTS) as engine:
        app = build_app(engine, model_name=MODEL, defaults=DEFAULTS)
        with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
            engine.close()
            answer = client.post("/v1/completions", json={"prompt": "Hi"})
            assert error_of(answer, 503)["code"] == "shutting_down"


@pytest.fixture(scope="module")
def real_server(default_smcsd):
    real = SMCConfig(n_particles=4, block_size=4, max_new_tokens=8)
    with served(default_smcsd, defaults=real, model_name=default_smcsd.target.name) as client:
        yield client


@pytest.fixture(scope="module")
def real_server_f32(default_smcsd_f32):
    real = SMCConfig(n_particles=4, block_size=4, max_new_tokens=12)
    with served(default_smcsd_f32, defaults=real, model_name=default_smcsd_f32.target.name) as client:
        yield client


@pytest.mark.slow
def test_the_openai_client_gets_the_target_s_logprobs_streamed_and_not(default_smcsd_f32, real_server_f32):
    client = openai.OpenAI(base_url=str(real_server_f32.base_url).rstrip("/") + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Name a color."}]
    ask = dict(model=real_model(real_server_f32), messages=messages, seed=3, max_tokens=12, temperature=0.7)
    assert client.chat.completions.create(**ask, logprobs=False).choices[0].logprobs is None
    ask |= dict(logprobs=True, top_logprobs=5, extra_body={"return_tokens_as_token_ids": True})
    whole = client.chat.completions.create(**ask).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    tok = default_smcsd_f32.tokenizer
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    for content in (whole, streamed):
        out = ids_of([t.token for t in content])
        expected = plain_logprobs(default_smcsd_f32.target.model, prompt, out, 0.7)
        assert len(out) >= 2
        for row, token, entry in zip(expected, out, content):
            assert abs(entry.logprob - row[token].item()) < 1e-3
            best = row.topk(5)
            assert ids_of([t.token for t in entry.top_logprobs]) == best.indices.tolist()
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-3)


def real_model(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


@pytest.mark.slow
def test_the_openai_client_streams_chat_as_it_answers_whole(real_server):
    client = openai.OpenAI(base_url=str(real_server.base_url).rstrip("/") + "/v1", api_key="unused")
    ask = dict(
        model=real_model(real_server),
        messages=[{"role": "user", "content": "Name a color."}],
        seed=3,
        max_tokens=8,
    )
    whole = client.chat.completions.create(**ask)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].model_extra["smcsd"]["seed"] == 3
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # the chat template was applied: the same text as a plain completion prompts differently
    plain = client.completions.create(
        model=real_model(real_server), prompt="Name a color.", seed=3, max_tokens=8
    )
    assert whole.usage.prompt_tokens > plain.usage.prompt_tokens


@pytest.mark.slow
def test_the_openai_client_gets_json_under_a_schema(real_server):
    client = openai.OpenAI(base_url=str(real_server.base_url).rstrip("/") + "/v1", api_key="unused")
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=real_model(real_server),
        messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        seed=1,
        max_tokens=24,
        extra_body={"n_particles": 4},
    )
    assert json.loads(out.choices[0].message.content)["answer"] in ("yes", "no")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])


def test_faults_get_their_errors_while_a_running_request_finishes(tiny_smcsd):
    with served(tiny_smcsd, defaults=UNENDING, max_queue=2) as client:
        steady = {"prompt": "The sun", "seed": 8, "max_tokens": 60, "block_size": 1}
        alone = client.post("/v1/completions", json=steady).json()["choices"][0]["text"]
        answers = []
        running = threading.Thread(target=lambda: answers.append(client.post("/v1/completions", json=steady)))
        running.start()
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
        error_of(client.post("/v1/completions", json={"prompt": "Hi", "response_format": bad}), 422)
        error_of(client.post("/v1/completions", json={"prompt": [5] * 200}), 400)
        with client.stream("POST", "/v1/completions", json=steady | {"seed": 9, "stream": True}) as killed:
            next(killed.iter_lines())
        running.join()
        [answer] = answers
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == alone
        wait_idle(client)


def test_shutdown_lets_a_running_request_finish_then_closes_the_engine(tiny_smcsd):
    answers = []
    with owned(tiny_smcsd, UNENDING) as engine:
        app = build_app(engine, model_name=MODEL, defaults=UNENDING)
        with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
            ask = {"prompt": "Once", "seed": 2, "max_tokens": 80, "block_size": 1}
            call = lambda: answers.append(httpx.post(f"{server.url}/v1/completions", json=ask, timeout=60))  # noqa: E731
            running = threading.Thread(target=call)
            running.start()
            while not gauge(client, "smcsd_rows_in_use"):
                time.sleep(0.01)
        running.join()
        [answer] = answers
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 80
        stats = engine.stats()
        assert stats.rows_in_use == stats.running == stats.queued == 0
        with pytest.raises(EngineClosed):
            engine.submit(ServeRequest([5, 6], UNENDING))


def test_a_round_of_the_fault_load_test_finds_a_sound_server(tiny_smcsd):
    """`smcsd load-test --faults` at CI size: every fault its 4xx, no 5xx or hang, idle after."""
    from smcsd_ppl.bench import faults

    with owned(tiny_smcsd, DEFAULTS, max_queue=4, max_rows=32) as engine:
        app = build_app(engine, model_name=MODEL, defaults=DEFAULTS)
        with BackgroundServer(app) as server:
            target = faults.Server(server.url, MODEL, max_tokens=6)
            records = faults.run_round(target, clients=4, per_client=6, burst=12, seed=3, timeout=120)
            rounds = [{"round": 1, "gauges": faults.gauges_after(target)}]
    rows = {r["kind"]: r for r in faults.summarize(records)}
    assert not faults.problems(list(rows.values()), rounds)
    expected = {"not_json": "400", "bad_schema": "422", "unknown_model": "404", "huge_prompt": "400"}
    for kind, code in expected.items():
        if kind in rows:
            assert set(rows[kind]["codes"]) == {code}, rows[kind]
    assert set(rows["burst"]["codes"]) <= {"200", "429"} and "200" in rows["burst"]["codes"]


def test_retry_after_is_the_queue_s_expected_wait():
    from smcsd_ppl.serving.app import queue_wait_seconds

    def stats(queued, completed, seconds):
        return dataclasses.replace(
            EngineStats(0, 0, 0, 1, 1, {"completed": 0}, 0, 0, 0.0, 0.0, 0.0),
            queued=queued,
            requests_total={"completed": completed},
            cycle_seconds_total=seconds,
        )

    assert queue_wait_seconds(stats(5, 0, 0.0)) == 1  # nothing finished yet: no rate to go by
    assert queue_wait_seconds(stats(5, 10, 20.0)) == 12  # 6 ahead at 2 s each
    assert queue_wait_seconds(stats(0, 100, 1.0)) == 1 and queue_wait_seconds(stats(500, 1, 10.0)) == 60


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_particles_all_die_gets_an_error_not_a_stop(tiny_smcsd, stream, monkeypatch):
    """Every block weighs zero (a program that rejects all it sees): an error, never a 200 "stop"."""
    real = SMCSDModel.extend

    async def rejected(self, *args, **kwargs):
        block = await real(self, *args, **kwargs)
        self.score(float("-inf"))
        return block

    monkeypatch.setattr(SMCSDModel, "extend", rejected)
    ask = {"prompt": "Hi", "max_tokens": 8, "seed": 1, "stream": stream}
    with served(tiny_smcsd) as client:
        reply = client.post("/v1/completions", json=ask)
    if not stream:
        error = error_of(reply, 500)
        assert error["code"] == "generation_failed" and "zero weight" in error["message"], error
        return
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    assert reply.status_code == 200 and "[DONE]" not in reply.text  # the stream ends with the error
    error = events[-1]["error"]
    assert error["code"] == "generation_failed" and "zero weight" in error["message"], error
    assert not any(c.get("finish_reason") == "stop" for e in events for c in e.get("choices", []))


POISON = 77  # a token id whose embedding is NaN in the test below


@pytest.fixture
def poisoned():
    """A pair whose target reads NaN at one token id (the rows holding it get NaN logits), served."""
    target, draft = tiny.pair()
    hook = target.model.get_input_embeddings().register_forward_hook(
        lambda _m, args, out: out.masked_fill((args[0] == POISON)[..., None], float("nan"))
    )
    pair = SMCSD(target, draft)
    try:
        with served(pair) as client:
            yield pair, client
    finally:
        hook.remove()


def test_nan_logits_fail_their_own_request_with_a_5xx_and_not_its_batch_mate(poisoned):
    pair, client = poisoned
    clean = {"prompt": [5, 6, 7, 8], "max_tokens": 12, "seed": 3}
    alone = client.post("/v1/completions", json=clean).json()["choices"][0]["text"]
    hold = threading.Thread(target=pair.call, args=(lambda: time.sleep(1.0),))
    hold.start()  # the engine runs a call meanwhile: both requests wait, then join one batch
    time.sleep(0.2)
    with ThreadPoolExecutor(2) as pool:
        bad, good = pool.map(
            lambda ask: client.post("/v1/completions", json=ask),
            [{"prompt": [5, POISON, 7], "max_tokens": 12, "seed": 3}, clean],
        )
    hold.join()
    error = error_of(bad, 500)
    assert error["code"] == "engine_fault" and "NaN" in error["message"], error
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == alone
    assert client.get("/health").status_code == 200  # the engine goes on


@pytest.mark.parametrize(
    "bad",
    [
        {"regex": "(19|20[0-9"},
        {"grammar": "start: (("},
        {"grammar": 'start: "a" b'},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}}},
    ],
)
def test_a_bad_constraint_gets_a_4xx_json_error_and_the_server_goes_on(tiny_smcsd, bad):
    with served(tiny_smcsd) as client:
        reply = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **bad})
        assert 400 <= reply.status_code < 500, reply.text
        error = reply.json()["error"]
        assert error["param"] == next(iter(bad)) and error["code"] in ("invalid_constraint", "invalid_schema")
        assert "cannot compile" in error["message"] or "JSON schema" in error["message"], error
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_the_docs_page_loads_nothing_from_elsewhere(tiny_server):
    """``/docs`` renders offline: every script, style and icon it names is served here."""
    page = tiny_server.get("/docs")
    assert page.status_code == 200 and "swagger" in page.text.lower()
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']|url: *["']([^"']+)["']""", page.text)
    urls = [a or b for a, b in urls]
    assert urls and all(u.startswith("/") and not u.startswith("//") for u in urls), urls
    for url in urls:
        assert tiny_server.get(url).status_code == 200, url
