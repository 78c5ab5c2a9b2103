"""Request bodies to scheduler requests: settings, seeds, constraints and their errors (no model)."""

from __future__ import annotations

import json

import pytest

from smcsd_ppl.config import MIN_TEMPERATURE, SMCConfig
from smcsd_ppl.serving.errors import APIError
from smcsd_ppl.serving.protocol import (
    ANY_JSON_OBJECT,
    choice_seed,
    parse_chat,
    parse_completion,
)

BASE = SMCConfig(max_new_tokens=16)


def test_choice_zero_keeps_the_seed_and_the_others_differ_deterministically():
    assert choice_seed(42, 0) == 42
    seeds = [choice_seed(42, i) for i in range(50)]
    assert len(set(seeds)) == 50 and seeds == [choice_seed(42, i) for i in range(50)]
    assert all(0 <= s < 2**63 for s in seeds) and choice_seed(43, 1) != choice_seed(42, 1)


def test_requests_are_prompt_major_with_a_seed_per_choice():
    call = parse_completion({"prompt": ["a", "b"], "n": 2, "seed": 9}, BASE)
    requests = call.requests([[1], [2]])
    assert [r.prompt_ids for r in requests] == [[1], [1], [2], [2]]
    assert [r.config.seed for r in requests] == [choice_seed(9, k) for k in range(4)]


def test_settings_map_onto_the_config():
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 5,
        "temperature": 0.7,
        "n_particles": 3,
        "block_size": 2,
        "seed": 1,
        "stop": "END",
        "method": "ar",
    }
    call = parse_chat(body, BASE)
    c = call.config
    assert (c.max_new_tokens, c.target_temperature, c.draft_temperature) == (5, 0.7, 0.7)
    assert (c.n_particles, c.block_size, c.seed, call.stop, call.method) == (3, 2, 1, ("END",), "ar")
    own_draft = parse_chat(body | {"draft_temperature": 0.3}, BASE).config
    assert (own_draft.target_temperature, own_draft.draft_temperature) == (0.7, 0.3)
    greedy = parse_chat(body | {"temperature": 0}, BASE).config
    assert (greedy.target_temperature, greedy.draft_temperature) == (0, MIN_TEMPERATURE)  # greedy
    low = parse_chat(body | {"temperature": 0.001}, BASE).config
    assert low.target_temperature == low.draft_temperature == MIN_TEMPERATURE
    assert parse_chat(body | {"proposal": "retrieval"}, BASE).config.proposal == "retrieval"
    with pytest.raises(APIError, match="proposal"):
        parse_chat(body | {"proposal": "beam"}, BASE)


def test_a_request_without_a_seed_gets_a_fresh_one():
    seeds = {parse_completion({"prompt": "a"}, BASE).config.seed for _ in range(5)}
    assert len(seeds) == 5


def test_response_format_and_extra_fields_name_the_constraint():
    assert parse_completion({"prompt": "a", "response_format": {"type": "text"}}, BASE).constraint is None
    assert (
        parse_completion({"prompt": "a", "response_format": {"type": "json_object"}}, BASE).constraint.text
        == ANY_JSON_OBJECT
    )
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    spec = parse_completion({"prompt": "a", "response_format": fmt}, BASE).constraint
    assert spec.kind == "schema" and json.loads(spec.text) == schema
    assert parse_completion({"prompt": "a", "regex": "[0-9]+"}, BASE).constraint.kind == "regex"
    assert parse_completion({"prompt": "a", "grammar": 'start: "x"'}, BASE).constraint.kind == "grammar"
    with pytest.raises(APIError) as two:
        parse_completion({"prompt": "a", "regex": "x", "response_format": {"type": "json_object"}}, BASE)
    assert two.value.status == 400


def test_a_schema_breaking_its_meta_schema_is_422():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    with pytest.raises(APIError) as bad:
        parse_completion({"prompt": "a", "response_format": fmt}, BASE)
    assert bad.value.status == 422 and bad.value.param == "response_format"
    assert str(bad.value).startswith("invalid JSON schema at #/type: 'strin' is not one of ['array',")
    with pytest.raises(APIError) as missing:
        parse_completion({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {}}}, BASE)
    assert missing.value.status == 422


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "seed": -1}, "seed"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True},
            "top_logprobs",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "regex": ""}, "regex"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 33}, "n"),
    ],
)
def test_bad_chat_bodies_name_their_field(body, param):
    with pytest.raises(APIError) as err:
        parse_chat(body, BASE)
    assert err.value.status == 400 and err.value.param == param


def test_chat_content_parts_and_developer_messages_are_read_as_text():
    body = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        ]
    }
    [messages] = parse_chat(body, BASE).prompts
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.mark.parametrize("prompt", ["", [], [[]], ["ok", ""], [1, "a"], 5, [True]])
def test_bad_completion_prompts_are_refused(prompt):
    with pytest.raises(APIError) as err:
        parse_completion({"prompt": prompt}, BASE)
    assert err.value.param == "prompt"


def test_completion_prompts_may_be_texts_or_token_ids():
    assert parse_completion({"prompt": "a"}, BASE).prompts == ("a",)
    assert parse_completion({"prompt": [1, 2]}, BASE).prompts == ([1, 2],)
    assert parse_completion({"prompt": ["a", [3]]}, BASE).prompts == ("a", [3])
