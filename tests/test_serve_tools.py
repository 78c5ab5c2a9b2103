"""Tool calls with the official ``openai`` client: a named function or ``"required"``, streamed and not.

The arguments are generated under the function's JSON Schema, so each call parses and validates;
the embedded pair in float32 answers (20 calls over the four ways of asking). The tiny pair
checks what is refused, and that a conversation with tool messages reads.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_serve_http import MODEL, error_of, served

from smcsd_ppl.config import SMCConfig

pytestmark = pytest.mark.usefixtures("one_thread")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "a city's weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTIONS = [
    "What is the weather in Paris?",
    "Is it cold in Oslo?",
    "Add 2 and 3.",
    "Weather in Rome?",
    "What is 7+5?",
]


def streamed_call(chunks) -> tuple[str, str, str]:
    """A streamed answer's call, as a client accumulates it: name, arguments, finish reason."""
    chunks = list(chunks)
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    name = "".join(tc.function.name or "" for tc in deltas if tc.function)
    arguments = "".join(tc.function.arguments or "" for tc in deltas if tc.function)
    return name, arguments, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_tool_calls_parse_and_validate_against_their_schema(default_smcsd_f32, choice, stream):
    defaults = SMCConfig(n_particles=4, block_size=4, max_new_tokens=128)
    with served(default_smcsd_f32, defaults=defaults, model_name="m") as server:
        client = openai.OpenAI(base_url=str(server.base_url).rstrip("/") + "/v1", api_key="unused")
        for seed, question in enumerate(QUESTIONS):
            ask = dict(model="m", messages=[{"role": "user", "content": question}], tools=TOOLS, seed=seed)
            if stream:
                name, arguments, reason = streamed_call(
                    client.chat.completions.create(**ask, tool_choice=choice, stream=True)
                )
            else:
                answer = client.chat.completions.create(**ask, tool_choice=choice).choices[0]
                [call] = answer.message.tool_calls
                name, arguments, reason = call.function.name, call.function.arguments, answer.finish_reason
                assert answer.message.content is None and call.id.startswith("call_")
            assert reason == "tool_calls" and (name == "get_weather" or choice == "required")
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.fixture(scope="module")
def server(tiny_smcsd):
    with served(tiny_smcsd) as client:
        yield client


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"tools": TOOLS}, "tool_choice", '"auto" (the default with tools) is not supported'),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "name a function"),
        (
            {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": True},
            "parallel_tool_calls",
            "one",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "one of",
        ),
        ({"tool_choice": "required"}, "tools", "needs tools"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "each tool"),
        ({"tools": TOOLS, "tool_choice": NAMED, "regex": "a+"}, "tool_choice", "not both"),
    ],
)
def test_what_is_not_built_is_refused_by_name(server, extra, param, needle):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]} | extra
    error = error_of(server.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param and needle in error["message"], error


def test_tool_choice_none_answers_in_text_and_a_conversation_with_tool_messages_reads(server):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 3}
    answer = server.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert isinstance(answer["message"]["content"], str) and answer["finish_reason"] in ("stop", "length")
    named = server.post("/v1/chat/completions", json=body | {"tool_choice": NAMED, "max_tokens": 4}).json()
    assert named["choices"][0]["finish_reason"] == "length"  # cut short: the partial arguments, as they are
    assert named["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
