"""The OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of an engine client.

Routes: POST /v1/completions, /v1/chat/completions, /v1/responses (all also as server-sent
events), GET and DELETE /v1/responses/{id} (responses/), GET /v1/models, /health, /metrics,
/tokenizer_info, /dashboard and its /dashboard/data (dashboard/), POST /tokenize, /detokenize.
With an API key every route but /health and the dashboard's page needs
``Authorization: Bearer <key>``. Errors have OpenAI's shape (errors.py).

Shutdown (SIGTERM or SIGINT): stop admitting (new requests and /health get 503), let in-flight
requests finish until the drain deadline, abort the rest, close, exit 0. A second signal exits
at once.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.async_llm import EngineDeadError, EngineShuttingDownError
from engine.core.scheduler import QueueFullError
from engine.errors import RequestError
from engine.server import openapi
from engine.server.dashboard import routes as dashboard_routes
from engine.server.errors import APIError, error_body, to_api_error
from engine.server.inflight_cap import ClientCap
from engine.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engine.server.openai_serving import OpenAIServing
from engine.server.prometheus import EngineCollector, Rejections, make_registry, render
from engine.server.responses import routes as responses_routes
from engine.server.responses.protocol import ResponsesRequest
from engine.server.responses.serving import ResponsesServing
from engine.server.responses.store import ResponsesConfig, ResponseStore
from engine.server.streams import RequestStreams
from engine.server.tokenize_pool import Offloader
from engine.structured.compiler import GrammarBusyError

logger = logging.getLogger("engine.server")

MAX_BODY_BYTES = 16 * 1024 * 1024


class ServerState:
    def __init__(self) -> None:
        self.draining = False


def build_app(
    llm,
    served_model_names: list[str],
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    shutdown_engine: bool = True,
    enable_docs: bool = True,
    model_root: str | None = None,
    max_pending_per_client: int | None = None,
    tool_call_parser: str | None = None,
    responses: ResponsesConfig | None = None,
) -> FastAPI:
    """The ASGI app. ``llm`` is any EngineClient (engine_client.py); ``shutdown_engine``: shut it
    down when the app stops (off when the engine outlives the app, as in tests).
    ``enable_docs``: serve /openapi.json, /docs and /redoc (vLLM does by default).
    ``model_root``: what /v1/models shows as ``root`` (vLLM: the --model value as given).
    ``max_pending_per_client``: generation requests one client address may have in flight
    (inflight_cap.py); None: no per-client cap. ``tool_call_parser``: the tool-call format of
    the model's replies (tools.py); None: read from its chat template. ``responses``: the
    Responses API's settings (its store's size)."""
    root = model_root or served_model_names[0]
    serving = OpenAIServing(llm, served_model_names, tool_call_parser)
    responses_serving = ResponsesServing(
        serving, ResponseStore((responses or ResponsesConfig()).store_size)
    )
    offload = Offloader()
    rejections = Rejections()
    registry = make_registry(EngineCollector(llm, served_model_names[0], rejections))
    state = ServerState()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.draining = True
        offload.close()
        if shutdown_engine:
            await llm.shutdown(timeout=0.0)  # no-op if the drain already shut it down

    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="engine", version=_version(), lifespan=lifespan, **docs)
    openapi.install(
        app,
        [
            CompletionRequest,
            ChatCompletionRequest,
            ResponsesRequest,
            TokenizeRequest,
            DetokenizeRequest,
        ],
    )
    auth = bool(api_key)
    app.state.server = state
    app.state.llm = llm
    app.state.rejections = rejections
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    if max_pending_per_client:  # outermost: the cheapest answer for a client over its cap
        app.add_middleware(ClientCap, cap=max_pending_per_client, on_reject=rejections.add)

    def fail(err: APIError) -> JSONResponse:
        if err.status == 429:
            rejections.add(err.reason or "queue_full")
        elif err.status == 503:
            rejections.add(err.reason or "unavailable")
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return fail(exc)

    @app.exception_handler(RequestError)  # bad input outside generation (/tokenize): no trace
    async def _request_error(request: Request, exc: RequestError):
        return fail(to_api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return fail(_validation_api_error(exc.errors()))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return fail(to_api_error(exc))

    async def generation(
        request: Request, model: type[BaseModel], make_job, server=serving
    ) -> Response:
        if state.draining:
            raise to_api_error(EngineShuttingDownError("the server is shutting down"))
        body = await read_body(request, model, max_body_bytes)
        aliases = {"prompt": "messages"} if model is ChatCompletionRequest else None
        try:
            job = await offload(make_job, body)  # tokenizing, templates: off the event loop

            async def admit() -> RequestStreams:
                return await server.start(job, getattr(body, "request_id", None))

            streams = await cancel_on_disconnect(request, admit())
            if streams is None:
                return Response(status_code=499)
            if body.stream:
                return SSEResponse(server.stream(job, streams), streams)
            result = await cancel_on_disconnect(request, server.full_response(job, streams))
            if result is None:
                return Response(status_code=499)
            return JSONResponse(result)
        except (EngineDeadError, TimeoutError) as exc:
            # The engine or the cluster behind the router cannot serve (a worker died, the
            # staging area is full: 503) or the request passed the router's deadline (408):
            # worth one line, not a traceback (an exception left to the catch-all handler is
            # also re-raised to the server's log).
            err = to_api_error(exc, aliases)
            logger.warning("%s: %d: %s", request.url.path, err.status, exc)
            raise err from exc
        except (
            RequestError,
            QueueFullError,
            EngineShuttingDownError,
            GrammarBusyError,
        ) as exc:
            raise to_api_error(exc, aliases) from exc
        except APIError:
            raise
        except Exception as exc:  # a bug: a 500 whose traceback to_api_error logs, once
            raise to_api_error(exc) from exc

    generation_docs = dict(
        response_class=JSONResponse,
        responses={
            200: {
                "description": "The completion; server-sent events when stream is true",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
            **openapi.errors(400, 404, 413, 503, auth=auth),
        },
    )

    @app.post(
        "/v1/completions",
        openapi_extra=openapi.json_body(CompletionRequest),
        **generation_docs,
    )
    async def completions(request: Request) -> Response:
        return await generation(request, CompletionRequest, serving.completion_job)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=openapi.json_body(ChatCompletionRequest),
        **generation_docs,
    )
    async def chat_completions(request: Request) -> Response:
        return await generation(request, ChatCompletionRequest, serving.chat_job)

    responses_routes.install(
        app,
        responses_serving,
        lambda request: generation(
            request, ResponsesRequest, responses_serving.job, responses_serving
        ),
        generation_docs,
        auth,
    )

    @app.get("/v1/models", responses=openapi.errors(auth=auth))
    async def models() -> dict:
        cards = [model_card(llm, name, root) for name in served_model_names]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{name:path}", responses=openapi.errors(400, 404, auth=auth))
    async def model(name: str) -> dict:
        return model_card(llm, serving.check_model(name), root)

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {
                "description": "Healthy (an empty body; a cluster's lists its workers)",
                "content": None,
            },
            **openapi.errors(503),
        },
    )
    async def health() -> Response:
        if state.draining:
            return JSONResponse(error_body(503, "the server is shutting down"), 503)
        workers = getattr(llm, "workers_status", None)  # a cluster: list its workers
        if workers is not None:
            from engine.server.cluster_metrics import health_body

            ok = llm.is_healthy()
            body = health_body(workers(), ok)
            if not ok:
                body |= error_body(503, "the cluster has no live prefill and decode workers")
            return JSONResponse(body, 200 if ok else 503)
        if not llm.is_healthy():
            return JSONResponse(error_body(503, "the engine is not running"), 503)
        return Response(status_code=200)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **openapi.errors(auth=auth),
        },
    )
    async def metrics() -> Response:
        return Response(render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post(
        "/tokenize",
        openapi_extra=openapi.json_body(TokenizeRequest),
        responses=openapi.errors(400, 404, 413, auth=auth),
    )
    async def tokenize(request: Request) -> dict:
        body = await read_body(request, TokenizeRequest, max_body_bytes)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages must not be empty", "messages")
            tokens = await offload(
                serving.render_chat, body.messages, body.add_generation_prompt, None
            )
        else:
            tokens = await offload(
                llm.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
            )
        return {"count": len(tokens), "max_model_len": llm.max_model_len, "tokens": tokens}

    @app.post(
        "/detokenize",
        openapi_extra=openapi.json_body(DetokenizeRequest),
        responses=openapi.errors(400, 404, 413, auth=auth),
    )
    async def detokenize(request: Request) -> dict:
        body = await read_body(request, DetokenizeRequest, max_body_bytes)
        serving.check_model(body.model)
        vocab = llm.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range [0, {vocab})", "tokens")
        return {"prompt": await offload(llm.tokenizer.decode, body.tokens)}

    dashboard_routes.install(app, llm, served_model_names[0], rejections, auth)

    @app.get("/tokenizer_info", responses=openapi.errors(auth=auth))
    async def tokenizer_info() -> dict:
        return tokenizer_card(llm)

    return app


def _version() -> str:
    try:
        return importlib.metadata.version("engine")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def tokenizer_card(llm) -> dict:
    """vLLM's /tokenizer_info: the special tokens spelled out and the chat template, what a
    client needs to tokenize as the server does over /tokenize (lm-eval's remote tokenizer)."""
    tok = llm.tokenizer
    specials = getattr(tok, "special_tokens", {})
    return {
        "tokenizer_class": type(tok).__name__,
        **{k: specials.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")},
        "chat_template": getattr(tok, "chat_template", None),
        "model_max_length": llm.max_model_len,
    }


def model_card(llm, name: str, root: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "engine",
        "root": root,
        "max_model_len": llm.max_model_len,
    }


# -- request plumbing ------------------------------------------------------------------------


async def read_body(request: Request, model: type[BaseModel], limit: int):
    """Read at most ``limit`` bytes and validate them strictly; 413 or 400 naming the field."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body must be at most {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body must be at most {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or closed by a read deadline: nobody to answer
        raise APIError(408, "the client went away before sending the whole body") from None
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as exc:
        raise _validation_api_error(exc.errors()) from None


def _validation_api_error(errors) -> APIError:
    if not errors:
        return APIError(400, "invalid request body")
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {e.get('msg')}")
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {e.get('msg')}")
    # A union field reports one error per member type ("prompt.str", "prompt.list[int].0"):
    # name the types it accepts instead of the first member's complaint.
    kinds = [
        str(x["loc"][1])
        for x in errors
        if len(x.get("loc", ())) > 1 and x["loc"][0] == e["loc"][0] and _is_type_tag(x["loc"][1])
    ]
    if len(kinds) > 1:
        accepted = ", ".join(dict.fromkeys(kinds))
        return APIError(400, f"{loc[0]} must be one of these types: {accepted}", loc[0])
    where = ".".join(loc)
    return APIError(400, f"{where}: {e.get('msg')}", loc[0])


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "dict", "list") or "[" in part
    )


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, coro):
    """Run ``coro``, cancelling it if the client goes away first (then None). Cancelling a
    generation closes its engine streams, which aborts the requests and frees their KV."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        return None
    return work.result()


class SSEResponse(StreamingResponse):
    """Server-sent events that always close their engine streams, even when the client is gone
    before the first byte (then the body iterator never runs)."""

    def __init__(self, content, streams: RequestStreams) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._streams.aclose()


class BearerAuth:
    """Pure ASGI middleware (it does not buffer streamed responses): every route but the public
    ones needs ``Authorization: Bearer <api_key>``. The scheme name is case-insensitive (RFC
    7235; vLLM compares it case-sensitively). Public: /health and the API's description
    (/openapi.json, /docs, /redoc), as in vLLM, and the dashboard's page (it holds no data; its
    data calls need the key: dashboard/routes.py); unlike vLLM, /metrics and /tokenize need the
    key too, since they expose traffic and the vocabulary."""

    PUBLIC = frozenset(
        ("/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/dashboard")
    )

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.PUBLIC:
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.strip().partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)
            if not ok:
                response = JSONResponse(
                    error_body(401, "a valid API key is required (Authorization: Bearer <key>)"),
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
