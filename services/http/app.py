"""The OpenAI-compatible HTTP API over the front door, in the serving process's event loop.

- ``create_app(door, settings)``: the FastAPI app. ``POST /v1/completions``, ``POST /v1/chat/completions``
  (non-streamed, or SSE with ``stream: true`` ending in ``data: [DONE]``), ``GET /v1/models`` (with the context
  length, ``max_model_len``, as vLLM gives it), ``POST /tokenize``, ``POST /detokenize`` and ``GET
  /tokenizer_info`` (vLLM's shapes: a remote tokenizer, e.g. the evaluation harness's, speaks them), ``GET
  /health``, ``GET /version``, ``GET /metrics`` (the scheduler's own Prometheus exposition). The model is served
  under ``CDB_SERVED_MODEL_NAME`` (``cdb serve --served-model-name``): every name is accepted as a request's
  ``model``, the first is the one reported. A body may ask for several choices (a completion's list of prompts,
  ``n``): one engine request each (``calls.Choice``), joined into one response or one SSE stream; ``echo`` begins a
  completion with its prompt and, with ``logprobs``, the prompt's full-depth logprobs (``max_tokens`` 0: only
  those). Chats render with the tokenizer's chat template or ``CDB_CHAT_TEMPLATE`` (``chat_template``).
  Requests go through the same front door (``services.api.door``) as the gRPC API: its admission, drain,
  health verdict, metrics and traces cover them too.
- Request bodies over ``CDB_MAX_REQUEST_BYTES`` get 413 before they are parsed or their API key is checked, and
  bodies not received within ``CDB_BODY_READ_TIMEOUT_S`` 408 (``body_limit.BodyLimit``); building and validating a
  request (template, tokenization) runs off the event loop.
- Fair shares: a caller's generation requests count in its share (``services.api.shares``: its API key, else
  its client host), with the gRPC API's: over ``CDB_MAX_REQUESTS_PER_CALLER`` / ``CDB_MAX_STREAMS_PER_CALLER``
  (``stream: true``) it gets 429 ``rate_limit_exceeded`` naming the setting. Connections (``protocol``): request
  headers within ``CDB_HEADER_READ_TIMEOUT_S``, idle keep-alive ``CDB_HTTP_KEEP_ALIVE_S``, and a client that takes
  nothing of a response for ``CDB_STREAM_STALL_TIMEOUT_S`` is cut (its request aborted).
- ``serve_api``: ``create_app`` served by ``server.serve_http`` (uvicorn on the running loop) until cancelled.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from services.api.door import FrontDoor
from services.http.body_limit import BodyLimit
from services.http.context import ApiContext
from services.http.errors import ApiError, validation_error
from services.http.generation import GenerationRoutes
from services.http.server import serve_http
from services.http.tokens import TokenRoutes
from services.settings import Settings
from services.version import server_version


def create_app(
    door: FrontDoor,
    settings: Settings,
    *,
    model_names: Sequence[str] = (),
    api_keys: Collection[str] | None = None,
    chat_template: str | None = None,
) -> FastAPI:
    """The API over the front ``door`` (admission, draining, the health verdict, metrics and traces).
    ``model_names``: the names the model is served under, the first reported (default:
    ``settings.served_model_name``, else the engine's ``model``); ``api_keys``: default from
    ``settings`` (``CDB_API_KEYS`` / ``CDB_API_KEYS_FILE``, read as the gRPC port reads them; none: no key needed;
    ``/health``, ``/version`` and ``/metrics`` never need one); ``chat_template``: the template's path or text that
    renders chats instead of the tokenizer's (default: ``settings.chat_template``; ``ChatTemplateError`` when it
    cannot be read or does not compile)."""
    ctx = ApiContext(door, settings, model_names=model_names, api_keys=api_keys, chat_template=chat_template)
    app = FastAPI(title="cdb OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    # before parsing and the API-key check
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes, read_timeout_s=settings.body_read_timeout_s)
    _add_error_handlers(app)
    authorized = [Depends(ctx.authorized)]
    generation, tokens = GenerationRoutes(ctx), TokenRoutes(ctx)
    app.post("/v1/completions", dependencies=authorized)(generation.completions)
    app.post("/v1/chat/completions", dependencies=authorized)(generation.chat_completions)
    app.post("/tokenize", dependencies=authorized)(tokens.tokenize)
    app.post("/detokenize", dependencies=authorized)(tokens.detokenize)
    app.get("/tokenizer_info", dependencies=authorized)(tokens.tokenizer_info)
    served = ctx.served

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [ctx.model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=authorized)
    async def model(model: str) -> dict[str, Any]:
        ctx.check_model(model)
        return ctx.model_card()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": server_version()}

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = door.verdict()
        if reason is None:
            return JSONResponse({"status": "serving", "model": served})
        return JSONResponse({"status": "not_serving", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = await door.exposition(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error reply in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return ApiError(exc.status_code, str(exc.detail), code=code).response()


async def serve_api(
    door: FrontDoor,
    settings: Settings,
    address: str | None = None,
    *,
    on_bound: Callable[[str], None] | None = None,
    reuse_port: bool = False,
) -> None:
    """A scheduler's (or front end's) HTTP API: ``create_app`` served on ``address`` (default ``CDB_HTTP_ADDR``)
    until cancelled; ``reuse_port``: shared by several front-end processes.

    Start it as a task beside the gRPC server once the door exists; cancel and await it after the drain (the
    drain already covers HTTP requests, so the stop is quick)."""
    address = address or settings.http_addr
    if not address:
        raise ValueError("no address for the HTTP API (CDB_HTTP_ADDR or --http HOST:PORT)")
    app = create_app(door, settings)
    # the drain has already ended every request when this is cancelled: the stop only closes idle connections
    await serve_http(app, address, settings=settings, on_bound=on_bound, shutdown_timeout_s=2.0, reuse_port=reuse_port)
