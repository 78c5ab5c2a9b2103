"""The request bodies as pydantic models: each field's type, checked, and described in ``/openapi.json``.

The models hold what a body may say; ``protocol`` then checks what it means (ranges, one
constraint at most, settings SMC-SD can honour) and turns it into requests. A field no model
knows is kept aside for ``protocol``, which refuses it by name: nothing a client sends is
ignored in silence.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from .errors import APIError

Number = float  # an int is a valid float here (strict mode keeps "0.5" out)


class ContentPart(BaseModel):
    """A part of a message's content: only text parts are read."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: StrictStr
    text: StrictStr | None = None


class Message(BaseModel):
    """A chat message: ``developer`` is read as ``system``."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: StrictStr = Field(description="system, developer, user, assistant or tool")
    content: StrictStr | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    """``stream_options``."""

    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: StrictBool | None = Field(None, description="usage in a chunk of its own at the end")


class Sampling(BaseModel):
    """The fields chat and completions share: OpenAI's, then SMC-SD's own (``extra_body``)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: StrictStr | None = Field(None, description="the served model's id (or none)")
    max_tokens: StrictInt | None = Field(None, description="the budget of new tokens")
    max_completion_tokens: StrictInt | None = Field(None, description="the budget; wins over max_tokens")
    temperature: Number | None = Field(
        None, description="T_t (and T_d unless draft_temperature); 0 is greedy: the target's argmax path"
    )
    seed: StrictInt | None = Field(
        None, description="the request's seed (a fresh one if none, reported back)"
    )
    top_p: Number | None = Field(None, description="keep the likeliest tokens whose mass reaches p (1: all)")
    top_k: StrictInt | None = Field(None, description="keep the k likeliest tokens (-1 or 0: all)")
    min_p: Number | None = Field(None, description="keep tokens at least min_p as likely as the likeliest")
    logit_bias: dict[str, Number] | None = Field(
        None, description="token id -> bias (-100 to 100) added to its logit before the temperature"
    )
    n: StrictInt | None = Field(None, description="choices per prompt (at most 32 choices per request)")
    stop: StrictStr | list[StrictStr] | None = Field(None, description="up to 4 texts the output ends before")
    stream: StrictBool | None = Field(None, description="server-sent events")
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object, or json_schema with its schema (compiled by llguidance)"
    )
    user: StrictStr | None = Field(None, description="who asks (it changes nothing in the output)")
    safety_identifier: StrictStr | None = Field(None, description="who asks, hashed (changes nothing)")
    prompt_cache_key: StrictStr | None = Field(None, description="a caching hint (changes nothing)")
    # SMC-SD's own fields
    n_particles: StrictInt | None = Field(None, description="N, particles of the request")
    block_size: StrictInt | None = Field(
        None, description="K, the most tokens drafted per particle and cycle"
    )
    draft_temperature: Number | None = Field(None, description="T_d, the draft's temperature")
    ignore_eos: StrictBool | None = Field(None, description="always emit the whole budget")
    proposal: StrictStr | None = Field(None, description="auto, draft, retrieval or mixture")
    twist: StrictStr | None = Field(
        None, description="future-validity, structure, finite, lookahead, off, or auto (a schema's finite)"
    )
    method: StrictStr | None = Field(None, description="smcsd (default) or ar (the target alone)")
    regex: StrictStr | None = Field(None, description="the output matches this regex in full")
    grammar: StrictStr | None = Field(None, description="the output is a sentence of this Lark grammar")
    return_tokens_as_token_ids: StrictBool | None = Field(None, description="logprobs name tokens token_id:N")
    prompt_logprobs: StrictInt | None = Field(
        None, description="vLLM's: the prompt's log-probabilities, with 0-20 likeliest tokens at each place"
    )


class ChatCompletionRequest(Sampling):
    """A ``/v1/chat/completions`` body."""

    messages: list[Message] = Field(description="the conversation, in the model's chat template")
    logprobs: StrictBool | None = Field(None, description="the target's log-probability of each output token")
    top_logprobs: StrictInt | None = Field(
        None, description="0-20 likeliest tokens at each place, with logprobs"
    )
    tools: list[dict[str, Any]] | None = Field(None, description="functions the model may call")
    tool_choice: StrictStr | dict[str, Any] | None = Field(
        None, description='"none", "required", or a named function: its arguments follow its schema'
    )
    parallel_tool_calls: StrictBool | None = Field(None, description="false: one call per answer")


class CompletionRequest(Sampling):
    """A ``/v1/completions`` body."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr | list[StrictInt]] = Field(
        description="a text, token ids, or a list of them"
    )
    logprobs: StrictInt | StrictBool | None = Field(None, description="0-20 likeliest tokens at each place")
    echo: StrictBool | None = Field(
        None, description="the prompt first, in the text and logprobs (with max_tokens 0: scores alone)"
    )


def validated(model: type[Sampling], body: dict) -> Sampling:
    """``body`` as ``model``, or a 400 naming the first field at fault, in OpenAI's error shape."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        raise APIError(400, f"{where}: {first['msg']}", param=param, code="invalid_type") from None


class Usage(BaseModel):
    """Tokens of the request: each prompt counted once, every choice's output."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Diagnostics(BaseModel):
    """A choice's ``smcsd`` field: the settings that reproduce it and SMC-SD's report of it."""

    model_config = ConfigDict(extra="allow")
    method: str
    seed: int
    n_particles: int
    block_size: int
    log_z: float | None = Field(None, description="the log normalizer estimate (null: every particle died)")
    mean_ess: float | None = Field(None, description="mean ESS, out of N, over the cycles that ran N")
    n_resamples: int | None = None
    collapsed: bool | None = Field(None, description="the output follows the draft more than the target")
    tokens_per_target_call: float | None = None
    target_calls: int | None = None
    finish_reason: str = Field(description="stop, eos, length, constraint, cancelled or error")
    message: str = Field(description="why an output is empty or incomplete, if it is")


class ChatMessage(BaseModel):
    """The assistant's answer."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatMessage
    finish_reason: str | None = Field(description="stop, length or abort (a drain cut it)")
    logprobs: dict[str, Any] | None = None
    smcsd: Diagnostics


class CompletionChoice(BaseModel):
    """One choice of a completion."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(
        None, description="where asked: null, then per prompt token its own and the likeliest"
    )
    smcsd: Diagnostics


class ChatCompletion(BaseModel):
    """A ``/v1/chat/completions`` answer (not streamed)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(
        None, description="where asked: null, then per prompt token its own and the likeliest"
    )


class Completion(BaseModel):
    """A ``/v1/completions`` answer (not streamed)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: None = None


MODELS = (ChatCompletionRequest, CompletionRequest)  # the request bodies, as /openapi.json's components
