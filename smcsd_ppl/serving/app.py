"""The OpenAI-compatible HTTP app over a running engine (in this process, or an engine process).

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health`` and ``/metrics``.

``build_app`` returns a plain ASGI app (FastAPI), so uvicorn serves it (``smcsd serve``) and other
ASGI hosts can wrap the same object. The app owns the engine from then on: its shutdown closes it.
The app tokenizes, streams and answers; the engine runs the cycles.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from ..backends.base import CacheExhausted, EngineFault
from ..config import SMCConfig
from ..engine.client import EngineClosed, QueueFull, RequestCancelled
from .docs_page import add_docs_page
from .errors import APIError, GenerationFailed, failed
from .metrics import metrics_text
from .protocol import parse_chat, parse_completion
from .responses import Answer, diagnostics, logprobs_field, request_usage
from .schema import MODELS, ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest
from .scored import scored_response
from .streaming import ChoiceStreams, EventStream

DEFAULT_MAX_BODY_BYTES = 1 << 20
DISCONNECT_POLL_SECONDS = 0.25  # how often a waiting non-streamed request checks its client is there


class Service:
    """What the routes share: the engine (its tokenizer and models' names), the served name and settings.

    Args:
        engine: a running engine (``engine.client.Engine`` or ``engine.process.EngineProcess``).
        model_name: the ``model`` requests must name.
        defaults: settings of a request that sets none (its fixed fields are the engine's).
        api_key: the bearer token ``/v1`` routes require, or None for none.
        max_body_bytes: the largest request body accepted.
    """

    def __init__(self, engine, model_name, defaults, api_key, max_body_bytes) -> None:
        self.engine, self.model_name, self.defaults = engine, model_name, defaults
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.closing = False
        self.started = int(time.time())

    def check_key(self, request: Request) -> None:
        """401 unless the request carries ``Authorization: Bearer <api_key>`` (when a key is set)."""
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key"
            )

    async def read_body(self, request: Request) -> dict:
        """The JSON object of the body; 413 past ``max_body_bytes``, 400 if it is not a JSON object."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
        try:
            body = json.loads(data)
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    def check_model(self, body: dict) -> None:
        """404 unless the body names the served model (or none)."""
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model {model!r} is not served here; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def encode(self, prompt, tools=()) -> list[int]:
        """Token ids of a prompt: chat messages (the template, with ``tools``), token ids, or text."""
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if self.engine.chat and getattr(tokenizer, "chat_template", None):
                extra = {"tools": list(tools)} if tools else {}
                ids = tokenizer.apply_chat_template(
                    prompt, add_generation_prompt=True, tokenize=True, **extra
                )
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            else:  # no template: the messages' text, one after another
                ids = tokenizer("\n".join(m["content"] for m in prompt))["input_ids"]
            return [int(t) for t in ids]
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < len(tokenizer)]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="prompt")
            return list(prompt)
        return [int(t) for t in tokenizer(prompt)["input_ids"]]

    def check_engine(self) -> None:
        """Refuse (503) once the engine's process has ended on its own: nothing can answer any more."""
        if not getattr(self.engine, "alive", True):
            note = self.engine.exit_note
            raise APIError(
                503, f"the engine process ended ({note}); the server is stopping", code="engine_dead"
            )

    def submit(self, requests: list) -> list:
        """Submit every choice, or none: a refusal cancels those already in and becomes an ``APIError``."""
        self.check_engine()
        if self.closing:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        tickets = []
        try:
            for request in requests:
                tickets.append(self.engine.submit(request))
        except (QueueFull, EngineClosed, ValueError) as err:
            for ticket in tickets:
                ticket.cancel()
            raise refusal(err, self.engine.stats()) from None
        return tickets


def queue_wait_seconds(stats) -> int:
    """When a request refused for a full queue may come back: the queue's expected wait, 1-60 s.

    The requests waiting (and this one) over the rate requests complete per second of cycles;
    1 s before any has completed.
    """
    done = stats.requests_total.get("completed", 0)
    if not done or stats.cycle_seconds_total <= 0:
        return 1
    return max(1, min(60, math.ceil((stats.queued + 1) * stats.cycle_seconds_total / done)))


def refusal(err: BaseException, stats=None) -> APIError:
    """The error a request's failure answers with (``stats``: the engine's, for a full queue's wait)."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, QueueFull):
        wait = 1 if stats is None else queue_wait_seconds(stats)
        message = f"the queue is full, try again later: {err}"
        return APIError(429, message, code="queue_full", retry_after=wait)
    if isinstance(err, (EngineClosed, RequestCancelled)):
        return APIError(503, f"the server is shutting down: {err}", code="shutting_down")
    if isinstance(err, GenerationFailed):
        return failed(str(err))
    if isinstance(err, CacheExhausted):  # what runs now holds the cache: later, it may fit
        return APIError(503, str(err), code="cache_exhausted", retry_after=1)
    if isinstance(err, EngineFault):
        return APIError(500, str(err), code="engine_fault")
    if isinstance(err, ValueError):
        return APIError(400, str(err), code="invalid_request")
    return APIError(500, f"generation failed: {type(err).__name__}: {err}")


def build_app(
    engine,
    *,
    model_name: str,
    defaults: SMCConfig | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The ASGI app serving through ``engine``; its shutdown closes the engine.

    Args:
        engine: a running engine (``engine.client.Engine`` or ``engine.process.EngineProcess``).
        model_name: the id ``/v1/models`` lists and requests must name (or leave out).
        defaults: the settings of a request that sets none (``SMCConfig()`` when None); the fields
            a request cannot set (alpha, cut, resampling, ...) must be the engine's.
        api_key: the bearer token the ``/v1`` routes require; None: open.
        max_body_bytes: the largest request body (413 past it).
    """
    service = Service(engine, model_name, defaults or SMCConfig(), api_key, max_body_bytes)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        service.closing = True  # requests still arriving get 503
        await asyncio.to_thread(engine.close, cancel=True)

    app = FastAPI(title="smcsd_ppl", lifespan=lifespan, redoc_url=None, docs_url=None)
    app.openapi = partial(openapi_schema, app)
    app.state.service = service
    add_docs_page(app)
    add_error_bodies(app)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=request_body(ChatCompletionRequest),
        responses={200: {"model": ChatCompletion, "description": "the answer (or, streamed, its chunks)"}},
    )
    async def chat(request: Request):
        """OpenAI's chat completions, sampled by SMC-SD (the body is read as its model says)."""
        return await complete(service, request, "chat")

    @app.post(
        "/v1/completions",
        openapi_extra=request_body(CompletionRequest),
        responses={200: {"model": Completion, "description": "the answer (or, streamed, its chunks)"}},
    )
    async def completions(request: Request):
        """OpenAI's (legacy) completions, sampled by SMC-SD."""
        return await complete(service, request, "completion")

    add_info_routes(app, service)
    return app


def add_error_bodies(app: FastAPI) -> None:
    """Every failure answers with OpenAI's error body, never bare text."""

    @app.exception_handler(APIError)
    async def api_error(_request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers())

    @app.exception_handler(HTTPException)
    async def http_error(_request, err: HTTPException):  # unknown routes and methods
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def server_error(_request, err: Exception):  # a bug of ours
        fault = refusal(err)
        return JSONResponse(fault.body(), status_code=fault.status, headers=fault.headers())


def request_body(model) -> dict:
    """The OpenAPI request body of a route that reads its JSON itself (size limit, key first)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def openapi_schema(app: FastAPI) -> dict:
    """``/openapi.json``: FastAPI's, with the request models (and the models they use) as components."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in MODELS:
            own = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components |= own.pop("$defs", {}) | {model.__name__: own}
        app.openapi_schema = schema
    return app.openapi_schema


def add_info_routes(app: FastAPI, service: Service) -> None:
    """``/health``, ``/metrics`` (both open) and ``/v1/models``."""

    @app.get("/health")
    async def health():
        service.check_engine()
        if service.closing:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        return {"status": "ok", "model": service.model_name}

    @app.get("/metrics")
    async def metrics():
        text, content_type = metrics_text(service.engine.stats)
        return Response(text, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        service.check_key(request)
        return {"object": "list", "data": [model_card(service)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        service.check_key(request)
        if name != service.model_name:
            raise APIError(404, f"model {name!r} is not served here", param="model", code="model_not_found")
        return model_card(service)


def model_card(service: Service) -> dict:
    """The ``/v1/models`` entry of the served pair, its models named in ``smcsd``."""
    return {
        "id": service.model_name,
        "object": "model",
        "created": service.started,
        "owned_by": "smcsd_ppl",
        "smcsd": dict(service.engine.names),
    }


async def complete(service: Service, request: Request, kind: str):
    """A completion request, chat or text: checked, encoded, submitted, then streamed or awaited."""
    service.check_key(request)
    body = await service.read_body(request)
    service.check_model(body)
    call = (parse_chat if kind == "chat" else parse_completion)(body, service.defaults)
    prompt_ids = await asyncio.to_thread(lambda: [service.encode(p, call.tools) for p in call.prompts])
    requests = call.requests(prompt_ids)
    tickets = await asyncio.to_thread(service.submit, requests)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    answer = Answer(kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), service.model_name, call.tool)
    tokenizer = None if call.tokens_as_ids else service.engine.tokenizer

    def fields(gen, req) -> dict:  # what a finished choice carries beside its text
        return {"smcsd": diagnostics(gen, req), "logprobs": _logprobs(kind, tokenizer, gen)}

    if call.stream:
        streams = ChoiceStreams(answer, tickets, call.n, requests, call.include_usage, fields, refusal)
        return EventStream(streams.events(), streams.close)
    gens = await results_unless_gone(request, tickets)
    for i, gen in enumerate(gens):  # a request that failed gets an error, never a 200 "stop"
        if gen.finish_reason == "error":
            raise failed(f"choice {i}: {gen.message}" if len(gens) > 1 else gen.message)
    if call.echo or call.prompt_logprobs is not None or not call.generates:
        reasons = [t.finish_reason.openai for t in tickets]
        decode, namer = service.engine.tokenizer.decode, token_namer(tokenizer)
        body = scored_response(
            call, answer, gens, reasons, prompt_ids, decode, namer, lambda g, i: fields(g, requests[i])
        )
        return JSONResponse(body)
    choices = [
        answer.choice(i, g.text, t.finish_reason.openai, **fields(g, r))
        for i, (g, t, r) in enumerate(zip(gens, tickets, requests))
    ]
    return JSONResponse(answer.response(choices, request_usage(tickets, call.n)))


def _logprobs(kind: str, tokenizer, gen) -> dict | None:
    """A choice's ``logprobs`` field, its tokens' texts decoded one by one (None: ``token_id:N``)."""
    return logprobs_field(kind, gen.logprobs, token_namer(tokenizer))


def token_namer(tokenizer):
    """A token id -> its text, decoded alone (``token_id:N`` where ``tokenizer`` is None)."""
    if tokenizer is None:
        return lambda token: f"token_id:{token}"
    return lambda token: tokenizer.decode([token])


async def results_unless_gone(request: Request, tickets: list) -> list:
    """Every ticket's ``Generation``; if the client leaves first, its tickets are cancelled."""
    gathered = asyncio.ensure_future(asyncio.gather(*(t.result() for t in tickets)))

    async def gone() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not gathered.done():  # the client left: nothing to answer
        for ticket in tickets:
            ticket.cancel()
        gathered.cancel()
        raise APIError(499, "the client closed the request")
    try:
        return gathered.result()
    except Exception as err:
        for ticket in tickets:
            ticket.cancel()
        raise refusal(err) from None
