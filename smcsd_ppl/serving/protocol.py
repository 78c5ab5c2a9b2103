"""What an OpenAI-style request body asks for, checked: prompts, choices, settings and constraint.

Pure functions of the JSON body and the server's base settings; no model is touched here. The
body's types are the pydantic models' (``schema``); what they mean is checked here. The body
fields beyond OpenAI's (``EXTRA_FIELDS``) carry SMC-SD's own settings and constraints.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass

from ..config import MAX_SEED, MIN_TEMPERATURE, SMCConfig
from ..engine.client import SERVE_METHODS, ServeRequest
from ..engine.scoring import MAX_TOP_LOGPROBS
from ..keys import derive
from ..potentials.spec import ConstraintSpec
from .errors import APIError, invalid
from .schema import ChatCompletionRequest, CompletionRequest, validated
from .tools import ToolChoice, tool_choice
from .unhonoured import refuse_unhonoured

# Body fields beyond OpenAI's, each the SMCConfig field (or request setting) it sets.
EXTRA_FIELDS = {
    "n_particles": "n_particles",
    "block_size": "block_size",
    "draft_temperature": "draft_temperature",
    "ignore_eos": "ignore_eos",
    "proposal": "proposal",
    "twist": "twist",  # "future-validity", "structure", "finite" or "lookahead"; "off" (or null) for none
}
CONSTRAINT_FIELDS = ("regex", "grammar")  # extra fields: the constraint's text
MAX_CHOICES = 32  # prompts x n of one HTTP request
MAX_STOPS = 4  # OpenAI's limit on stop strings
# A JSON object of any shape: what response_format json_object asks for.
ANY_JSON_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class Call:
    """One HTTP request, checked.

    Attributes:
        prompts: chat: one list of messages; completions: each prompt, a text or token ids.
        n: choices per prompt.
        stream: answer with server-sent events.
        include_usage: ``stream_options.include_usage``: usage in a chunk of its own at the end.
        config: the settings of choice 0 (its seed ``seed``).
        method: one of ``SERVE_METHODS``.
        constraint: the output's constraint, if any.
        stop: stop strings.
        logprobs: the target's log-probabilities asked for, with this many alternatives per
            token (None: not asked).
        tokens_as_ids: name each token of ``logprobs`` as ``token_id:N`` rather than by its text
            (vLLM's ``return_tokens_as_token_ids``).
        echo: each choice's text and ``logprobs`` begin with its prompt's (completions only).
        prompt_logprobs: the prompt's log-probabilities asked for (vLLM's field), with this many
            alternatives per token (None: not asked).
        generates: False where ``max_tokens`` is 0: the prompt is scored, no token is returned.
        tool: the tool call asked for (chat), whose schema is ``constraint``; None: none.
        tools: the request's tools, for the chat template.
    """

    prompts: tuple
    n: int
    stream: bool
    include_usage: bool
    config: SMCConfig
    method: str
    constraint: ConstraintSpec | None
    stop: tuple[str, ...]
    logprobs: int | None = None
    tokens_as_ids: bool = False
    echo: bool = False
    prompt_logprobs: int | None = None
    generates: bool = True
    tool: ToolChoice | None = None
    tools: tuple = ()

    @property
    def prompt_scores(self) -> int | None:
        """The alternatives per prompt token the engine gives (None: it scores no prompt)."""
        if self.prompt_logprobs is not None:
            return max(self.prompt_logprobs, self.logprobs or 0)
        return self.logprobs if self.echo else None

    def requests(self, prompt_ids: list[list[int]]) -> list[ServeRequest]:
        """One request per choice, prompt-major: choice ``k`` is prompt ``k // n``, seeded by ``choice_seed``.

        Args:
            prompt_ids: each prompt's token ids.
        """
        return [
            ServeRequest(
                ids,
                dataclasses.replace(self.config, seed=choice_seed(self.config.seed, p * self.n + j)),
                self.method,
                self.constraint,
                self.stop,
                self.logprobs,
                self.prompt_scores,
            )
            for p, ids in enumerate(prompt_ids)
            for j in range(self.n)
        ]


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index``: ``seed`` for choice 0, then a key derived from it (``keys.derive``).

    Choice 0 keeps the seed so that a request with ``n=1`` is choice 0 of the same request with any ``n``.
    """
    if index == 0:
        return seed
    return derive(seed, "choice", index) & MAX_SEED


def parse_chat(body: dict, base: SMCConfig) -> Call:
    """A ``/v1/chat/completions`` body."""
    refuse_unhonoured(validated(ChatCompletionRequest, body), body)
    messages = (_messages(body.get("messages")),)
    call = _call(body, base, messages, _chat_logprobs(body), echo=False, tool=tool_choice(body))
    return dataclasses.replace(call, tools=tuple(body.get("tools") or ()))


def parse_completion(body: dict, base: SMCConfig) -> Call:
    """A ``/v1/completions`` body (``prompt``: a text, a list of texts, token ids or lists of them)."""
    refuse_unhonoured(validated(CompletionRequest, body), body)
    return _call(body, base, _prompts(body.get("prompt")), _completion_logprobs(body), _bool(body, "echo"))


def _call(
    body: dict,
    base: SMCConfig,
    prompts: tuple,
    logprobs: int | None,
    echo: bool,
    tool: ToolChoice | None = None,
) -> Call:
    n = _int(body, "n", 1)
    if n < 1 or n * len(prompts) > MAX_CHOICES:
        raise invalid(f"n must be at least 1, and prompts x n at most {MAX_CHOICES}", "n")
    method = body.get("method", "smcsd")
    if method not in SERVE_METHODS:
        raise invalid(f"method must be one of {', '.join(SERVE_METHODS)}, got {method!r}", "method")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    config, constraint = _config(body, base), _constraint(body)
    if tool is not None:  # a tool call is a schema's constraint
        if constraint is not None:
            raise invalid(
                "give tool_choice or a constraint (response_format, regex, grammar), not both", "tool_choice"
            )
        constraint = tool.spec
    config = dataclasses.replace(config, twist=config.twist_on(constraint))  # its response says which ran
    prompt_logprobs = _top(body, "prompt_logprobs")
    stream = _bool(body, "stream")
    if stream and (echo or prompt_logprobs is not None or _budget(body) == 0):
        raise invalid(
            "echo, prompt_logprobs and max_tokens 0 are answered whole: ask without stream", "stream"
        )
    return Call(
        prompts,
        n,
        stream,
        bool(options.get("include_usage")),
        config,
        method,
        constraint,
        _stops(body.get("stop")),
        logprobs,
        _bool(body, "return_tokens_as_token_ids"),
        echo,
        prompt_logprobs,
        _budget(body) != 0,
        tool,
    )


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (true or false) and ``top_logprobs`` (0-20): the alternatives asked, or None."""
    wanted = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
    if top and not wanted:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return top if wanted else None


def _completion_logprobs(body: dict) -> int | None:
    """Completions' ``logprobs``: how many alternatives per token (0-20), or None (not asked)."""
    if body.get("logprobs") is False:
        return None
    return _top(body, "logprobs")


def _top(body: dict, name: str) -> int | None:
    """A count of alternatives per token, 0-20 (None: not asked)."""
    if body.get(name) is None:
        return None
    top = _int(body, name, 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"{name} must be from 0 to {MAX_TOP_LOGPROBS}, got {top}", name)
    return top


def _budget(body: dict) -> int | None:
    """The budget of new tokens the body sets (``max_completion_tokens`` wins), or None."""
    name = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    return None if name is None else body[name]


def _config(body: dict, base: SMCConfig) -> SMCConfig:
    """The base settings with the body's: each checked alone, so an error names its body field."""
    changes = {}  # SMCConfig field -> (the body field that sets it, its value)
    for name, field in EXTRA_FIELDS.items():
        if body.get(name) is not None:
            changes[field] = (name, body[name])
    if "twist" in body and body["twist"] in (None, "off"):
        changes["twist"] = ("twist", None)
    budget = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    if budget:
        # 0 asks for the prompt's scores alone: one token is drawn, and none is returned.
        changes["max_new_tokens"] = (budget, body[budget] or 1)
    if body.get("temperature") is not None:
        t = body["temperature"]
        number = isinstance(t, (int, float)) and not isinstance(t, bool)
        if number and 0 < t < MIN_TEMPERATURE:
            t = MIN_TEMPERATURE  # the lowest temperature the weights resolve (0 itself is greedy)
        changes["target_temperature"] = ("temperature", t)
        # Greedy drafts at the lowest temperature: the draft's likeliest tokens pass most often.
        changes.setdefault("draft_temperature", ("temperature", MIN_TEMPERATURE if number and t == 0 else t))
    changes |= _sampling(body)
    seed = body.get("seed")
    changes["seed"] = ("seed", secrets.randbelow(MAX_SEED + 1) if seed is None else seed)
    for field, (param, value) in changes.items():
        try:
            dataclasses.replace(base, **{field: value})
        except (ValueError, TypeError) as err:
            raise invalid(str(err).replace(field, param), param) from None
    return dataclasses.replace(base, **{field: value for field, (_, value) in changes.items()})


def _sampling(body: dict) -> dict:
    """The processed target's settings the body gives: top-k (-1: all, as 0), top-p, min-p, logit bias."""
    changes = {name: (name, body[name]) for name in ("top_p", "min_p") if body.get(name) is not None}
    if body.get("top_k") is not None:
        changes["top_k"] = ("top_k", 0 if body["top_k"] == -1 else body["top_k"])
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() for k in bias):
            raise invalid("logit_bias maps token ids (as strings) to biases from -100 to 100", "logit_bias")
        # OpenAI's and vLLM's bound: +-100 already makes a token certain or impossible in practice.
        pairs = tuple((int(k), max(-100.0, min(100.0, float(v)))) for k, v in bias.items())
        changes["logit_bias"] = ("logit_bias", pairs)
    return changes


def _constraint(body: dict) -> ConstraintSpec | None:
    """The one constraint the body asks for: ``response_format`` (JSON), ``regex`` or ``grammar``."""
    found = [_spec(kind, body[kind]) for kind in CONSTRAINT_FIELDS if _text(body, kind)]
    schema = _response_schema(body.get("response_format"))
    if schema is not None:
        found.append(schema)
    if len(found) > 1:
        raise invalid("give at most one of response_format (JSON), regex and grammar", "response_format")
    return found[0] if found else None


def _spec(kind: str, text: str) -> ConstraintSpec:
    """A regex's or grammar's spec, compiled now: a mistake in it is the caller's (400, naming the field)."""
    try:
        return ConstraintSpec(kind, text)
    except ValueError as err:
        raise APIError(400, str(err), param=kind, code="invalid_constraint") from None


def _response_schema(fmt) -> ConstraintSpec | None:
    """``response_format``: ``text`` (none), ``json_object`` (any object) or ``json_schema`` (its schema)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("schema", ANY_JSON_OBJECT)
    if kind != "json_schema":
        raise invalid("response_format.type must be text, json_object or json_schema", "response_format")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, (dict, bool)):
        raise APIError(
            422, "response_format.json_schema.schema must be a JSON Schema", param="response_format"
        )
    try:
        return ConstraintSpec("schema", json.dumps(schema))  # checked against its meta-schema
    except ValueError as err:
        message = str(err) if str(err).startswith("cannot") else f"invalid {err}"
        raise APIError(422, message, param="response_format", code="invalid_schema") from None


def _messages(messages) -> list[dict]:
    """Chat messages as the tokenizer's template takes them: role and text content."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise invalid("each message needs a role: system, developer, user, assistant or tool", "messages")
        content = m.get("content")
        if m["role"] == "assistant" and m.get("tool_calls") and not content:  # its calls, as JSON text
            content = json.dumps([c.get("function") for c in m["tool_calls"]], ensure_ascii=False)
        if isinstance(content, list):  # content parts: only text ones
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise invalid("only text content parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise invalid("a message's content must be text", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def _prompts(prompt) -> tuple:
    """Completion prompts: each a non-empty text or a non-empty list of token ids."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt must be a text, token ids, or a non-empty list of them", "prompt")
    for p in prompt:
        if not (isinstance(p, str) and p.strip()) and not (isinstance(p, list) and p and _is_ids(p)):
            raise invalid("each prompt must be non-empty text or a non-empty list of token ids", "prompt")
    return tuple(prompt)


def _is_ids(values: list) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _stops(stop) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop or []
    well = isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
    if not well or len(stops) > MAX_STOPS:
        raise invalid(f"stop must be a non-empty string or a list of at most {MAX_STOPS}", "stop")
    return tuple(stops)


def _int(body: dict, name: str, default: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(f"{name} must be an integer, got {value!r}", name)
    return value


def _bool(body: dict, name: str) -> bool:
    value = body.get(name) or False
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false", name)
    return value


def _text(body: dict, name: str) -> bool:
    """Whether the body sets ``name`` to text (a non-string is refused)."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, str) or not value.strip():
        raise invalid(f"{name} must be non-empty text", name)
    return True
