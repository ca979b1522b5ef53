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
- ``HttpServer`` / ``serve_http``: uvicorn on ``HOST:PORT`` on the running loop, without uvicorn's signal handlers
  (the scheduler owns SIGTERM and drains); stopping closes the listener, lets in-flight responses end for up to
  ``shutdown_timeout_s`` and then cuts them (which aborts their requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from cdb_engine.config import RequestParams
from cdb_engine.errors import InvalidRequest
from cdb_engine.validation import check_messages_size, check_text_size
from cdb_model.loader import load_generation_defaults
from services.api.door import FrontDoor, Ticket
from services.api.security import CallerAuth, read_api_keys
from services.api.shares import host_key, share_scope
from services.http.body_limit import BodyLimit
from services.http.calls import Choice, open_call
from services.http.chat_template import ChatTemplate, read_chat_template
from services.http.errors import ApiError, api_error, validation_error
from services.http.protocol import guarded_protocol
from services.http.responses import ChatRender, CompletionRender, merged_response
from services.http.schemas import (
    CHAT_FIELDS,
    FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from services.http.streaming import EventStream, sse_body, until_done_or_gone
from services.settings import Settings, served_names
from services.version import server_version

log = logging.getLogger("cdb.http")


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
    prep = door.prep
    templates = ChatTemplate(prep.tokenizer, read_chat_template(chat_template or settings.chat_template))
    names = list(model_names) or served_names(settings.served_model_name) or [prep.config.model]
    served = names[0]
    if api_keys is not None:
        auth = CallerAuth(api_keys)
    else:  # the gRPC port's keys when it has some, else the settings' (a door built without its port's auth)
        auth = door.auth if door.auth.keys_on else CallerAuth(read_api_keys(settings))
    created = int(time.time())
    generation = load_generation_defaults(prep.config.model)  # sampling defaults of unset fields, max_new_tokens
    app = FastAPI(title="cdb OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    # before parsing and the API-key check
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes, read_timeout_s=settings.body_read_timeout_s)

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

    def authorized(request: Request) -> None:
        why = auth.refusal(request.headers.items())
        if why is not None:
            raise ApiError(401, f"{why} (send the header 'Authorization: Bearer KEY')", code="invalid_api_key")

    def check_model(model: str | None) -> None:
        if model is not None and model not in names:
            known = ", ".join(f"'{n}'" for n in names)
            raise ApiError(
                404, f"the model '{model}' does not exist (served: {known})", param="model", code="model_not_found"
            )

    def model_card() -> dict[str, Any]:
        return {
            "id": served,
            "object": "model",
            "created": created,
            "owned_by": "cdb",
            "root": prep.config.model,  # what was loaded: a preset, a folder, a cache snapshot
            "parent": None,
            "max_model_len": prep.limits.max_total_tokens,  # the context length: prompt + generated tokens
        }

    async def run(
        request: Request,
        choices: Sequence[Choice],
        *,
        stream: bool,
        fields: Mapping[str, str],
        operation: str,
        max_tokens: int,
        echo: Callable[[Choice, Ticket], None] | None = None,
    ) -> Response:
        """Admit the request's choices, one engine request each (a refusal of any is the error reply, and ends
        those admitted before it), then stream them or answer once all have finished. ``echo(choice, call)``:
        what an admitted choice begins with (its prompt)."""
        headers = request.headers.items()
        response_id = choices[0].render.id
        calls: list[Ticket] = []
        where = fields
        try:
            caller = share_scope(auth.scope_of(headers), host_key(request.client.host if request.client else ""))
            for choice in choices:
                where = choice.fields
                call = await open_call(
                    door,
                    choice.request_id,
                    choice.prepare,
                    operation=operation,
                    max_tokens=max_tokens,
                    headers=headers,
                    caller=caller,
                    streaming=stream,
                )
                calls.append(call)
                if echo is not None:
                    echo(choice, call)
        except Exception as exc:
            for call in calls:
                await call.close()
            return api_error(exc, where).response()
        renders = [c.render for c in choices]
        reply_headers = {"X-Request-Id": response_id}
        if stream:
            return EventStream(sse_body(calls, renders, fields), calls, headers=reply_headers)
        try:
            await until_done_or_gone(calls, renders, request)
        except Exception as exc:
            return api_error(exc, fields).response()
        return JSONResponse(merged_response(renders), headers=reply_headers)

    def refused(exc: InvalidRequest, fields: Mapping[str, str]) -> JSONResponse:
        return api_error(exc, fields).response()

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """One choice per prompt and sample (``CompletionRequest.choices``); ``echo`` begins each with its prompt
        (with ``logprobs``: the prompt's, from the prefill at full depth)."""
        check_model(body.model)
        prompts = body.prompts()
        try:
            body.check_choices(len(prompts))
        except InvalidRequest as exc:
            return refused(exc, FIELDS)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        several = len(prompts) > 1
        choices = [
            Choice(
                CompletionRender(
                    response_id,
                    served,
                    prep.tokenizer,
                    include_usage=body.include_usage,
                    logprobs=body.logprobs is not None,
                    index=index,
                    sample=sample,
                ),
                functools.partial(body.to_engine, generation, prompt, sample),
                {**FIELDS, "prompt": f"prompt[{index // body.samples}]"} if several else FIELDS,
                prompt,
            )
            for index, prompt, sample in body.choices()
        ]

        def echo(choice: Choice, call: Ticket) -> None:
            prompt = choice.prompt
            text = prompt if isinstance(prompt, str) else prep.tokenizer.decode(call.prompt_ids)
            choice.render.echo_prompt(text, call.prompt_ids)

        return await run(
            request,
            choices,
            stream=body.stream,
            fields=FIELDS,
            operation="text_completion",
            max_tokens=body.requested_max_tokens(),
            echo=echo if body.echo and body.resume is None else None,  # a resumed stream echoed its prompt before
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """One choice per sample (``n``)."""
        check_model(body.model)
        fields = {**CHAT_FIELDS, "max_tokens": body.max_tokens_field}
        try:
            body.check_choices()
        except InvalidRequest as exc:
            return refused(exc, fields)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"

        def prepare(sample: int) -> tuple[str | list[int], RequestParams]:  # on a worker thread (admit)
            body.refuse_unsupported()
            chat = body.chat_messages()
            check_messages_size(chat)  # before the template renders them
            ids = templates.apply(chat, add_generation_prompt=True)
            requested = body.requested_max_tokens()
            if requested is None:  # the checkpoint's max_new_tokens, else up to the context limit
                requested = generation.max_new_tokens or max(1, prep.limits.max_total_tokens - len(ids))
            return ids, body.to_params(requested, generation, sample)

        choices = [
            Choice(
                ChatRender(
                    response_id,
                    served,
                    prep.tokenizer,
                    include_usage=body.include_usage,
                    logprobs=body.logprobs,
                    index=sample,
                    sample=sample,
                ),
                functools.partial(prepare, sample),
                fields,
            )
            for sample in range(body.samples)
        ]
        max_tokens = body.requested_max_tokens() or prep.limits.max_total_tokens
        return await run(request, choices, stream=body.stream, fields=fields, operation="chat", max_tokens=max_tokens)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorized)])
    async def model(model: str) -> dict[str, Any]:
        check_model(model)
        return model_card()

    def tokenize_ids(body: TokenizeRequest) -> list[int]:  # on a worker thread: templates and tokenizers are slow
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            chat = [{"role": m.role, "content": m.content or ""} for m in body.messages]
            check_messages_size(chat)
            return templates.apply(chat, add_generation_prompt=body.add_generation_prompt)
        if isinstance(body.prompt, list):
            check_token_ids(body.prompt, "prompt")
            return list(body.prompt)
        assert body.prompt is not None
        check_text_size(body.prompt, "prompt")
        return prep.tokenizer.encode(body.prompt)

    def check_token_ids(ids: Sequence[int], param: str) -> None:
        if len(ids) > prep.limits.max_total_tokens:
            raise ApiError(400, f"more than {prep.limits.max_total_tokens} token ids (max_model_len)", param=param)
        bad = [t for t in ids if not 0 <= t < prep.limits.vocab_size]
        if bad:
            raise ApiError(400, f"unknown token ids {bad[:5]} (vocabulary size {prep.limits.vocab_size})", param=param)

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(body: TokenizeRequest) -> Response:
        """Token ids of a prompt or a chat, as the completions endpoints would see them."""
        check_model(body.model)
        try:
            ids = await run_in_threadpool(tokenize_ids, body)
        except Exception as exc:
            return api_error(exc, CHAT_FIELDS if body.messages is not None else FIELDS).response()
        strs = [prep.tokenizer.decode([i], skip_special_tokens=False) for i in ids] if body.return_token_strs else None
        return JSONResponse(
            {"count": len(ids), "max_model_len": prep.limits.max_total_tokens, "tokens": ids, "token_strs": strs}
        )

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(body: DetokenizeRequest) -> Response:
        """The text of token ids (special tokens skipped, as in generated text)."""
        check_model(body.model)
        try:
            check_token_ids(body.tokens, "tokens")
            text = await run_in_threadpool(prep.tokenizer.decode, body.tokens)
        except Exception as exc:
            return api_error(exc, FIELDS).response()
        return JSONResponse({"prompt": text})

    @app.get("/tokenizer_info", dependencies=[Depends(authorized)])
    async def tokenizer_info() -> dict[str, Any]:
        """What a remote tokenizer needs: the class, sizes, special tokens and ids, and the chat template (the
        harness's remote tokenizer reads ``eos_token``: the stop string it adds, and the prefix of an empty
        context)."""
        tok = prep.tokenizer
        eos = tok.eos_token_id
        return {
            "tokenizer_class": type(tok).__name__,
            "vocab_size": prep.limits.vocab_size,
            "model_max_length": prep.limits.max_total_tokens,
            "eos_token": tok.decode([eos], skip_special_tokens=False) if eos is not None else None,
            "bos_token": None,  # none given: /tokenize adds what the tokenizer's own configuration says
            "pad_token": None,
            "eos_token_id": eos,
            "stop_token_ids": list(tok.stop_token_ids),
            "chat_template": templates.source,
        }

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


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: in the scheduler SIGTERM means drain, which the scheduler does."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(address: str, reuse_port: bool = False) -> socket.socket:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, int(port)), family=family, dualstack_ipv6=False, reuse_port=reuse_port)
    sock.setblocking(False)
    return sock


def _tls_options(settings: Settings) -> dict[str, Any]:
    """The public port's TLS (``CDB_TLS_CERT`` / ``CDB_TLS_KEY``; ``CDB_TLS_CLIENT_CA``: client certificates)."""
    if not settings.tls_cert:
        return {}
    out: dict[str, Any] = {"ssl_certfile": settings.tls_cert, "ssl_keyfile": settings.tls_key}
    if settings.tls_client_ca:
        out.update(ssl_ca_certs=settings.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return out


class HttpServer:
    """uvicorn serving ``app`` on ``address`` (``HOST:PORT``; port 0: any free port). The socket is bound and
    listening at construction, so ``address`` (the bound one) is known at once and connections queue until
    ``serve`` accepts them."""

    def __init__(
        self,
        app: FastAPI,
        address: str,
        *,
        settings: Settings | None = None,
        shutdown_timeout_s: float = 5.0,
        reuse_port: bool = False,
    ) -> None:
        self.socket = _listen(address, reuse_port)
        host, port = address.rpartition(":")[0] or "0.0.0.0", self.socket.getsockname()[1]
        self.address = f"{host}:{port}"
        self.scheme = "https" if settings is not None and settings.tls_cert else "http"
        limits = settings or Settings()
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            ws="none",
            http=guarded_protocol(limits.header_read_timeout_s, limits.stream_stall_timeout_s),
            timeout_keep_alive=limits.http_keep_alive_s,  # type: ignore[arg-type]  # a float works (call_later)
            timeout_graceful_shutdown=max(1, round(shutdown_timeout_s)),
            **(_tls_options(settings) if settings is not None else {}),
        )
        self._server = _Server(config)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"

    async def serve(self) -> None:
        """Serve until ``stop()`` (or cancellation, which stops gracefully first and then re-raises)."""
        task = asyncio.ensure_future(self._server.serve(sockets=[self.socket]))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            self.stop()
            await task
            raise

    def stop(self) -> None:
        """Begin the graceful stop (``serve`` returns once it is done)."""
        self._server.should_exit = True


async def serve_http(
    app: FastAPI,
    address: str,
    *,
    settings: Settings | None = None,
    shutdown_timeout_s: float = 5.0,
    on_bound: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    reuse_port: bool = False,
) -> None:
    """Serve ``app`` on ``address`` until ``stop`` is set or the task is cancelled; ``on_bound(HOST:PORT)`` once the
    socket listens. Either way the listener closes first and in-flight responses get ``shutdown_timeout_s``.
    ``reuse_port``: front-end processes share the port (``SO_REUSEPORT``)."""
    server = HttpServer(app, address, settings=settings, shutdown_timeout_s=shutdown_timeout_s, reuse_port=reuse_port)
    log.info("OpenAI-compatible HTTP API on %s", server.url)
    if on_bound is not None:
        on_bound(server.address)
    serving = asyncio.ensure_future(server.serve())
    stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        await asyncio.wait([t for t in (serving, stopping) if t is not None], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if stopping is not None:
            stopping.cancel()
        if not serving.done():
            server.stop()
        await serving


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
