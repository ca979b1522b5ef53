"""The ONE exception -> gRPC status map of the public API, and the decorator that applies it to a handler."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from cdb_engine.errors import CallerLimit, EngineStopped, InvalidRequest, Overloaded

log = logging.getLogger("cdb.scheduler")

# engine field names -> request field paths of GenerateRequest, so that errors name what the caller sent
_FIELD_PATHS = {
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",
    "logprobs": "sampling.top_logprobs",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "repetition_penalty": "sampling.repetition_penalty",
    "logit_bias": "sampling.logit_bias",
    "min_tokens": "sampling.min_tokens",
}


class StageFailed(Exception):
    """The engine failed a request because a stage (process) failed."""


class ServerDraining(Exception):
    """The server is shutting down: no new work, in-flight work cut at the drain deadline."""


class Unauthenticated(Exception):
    """The call carries no valid API key; the message says what is wrong (never the key)."""


class UndecodableRequest(Exception):
    """The request bytes do not parse; the message is ``field: problem`` (``services.api.decoding``)."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status of an exception raised while serving a request: the only such mapping."""
    if isinstance(exc, UndecodableRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, f"{_FIELD_PATHS.get(exc.field, exc.field)}: {exc.message}"
    if isinstance(exc, CallerLimit):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"server overloaded: {exc}"
    if isinstance(exc, StageFailed | EngineStopped | ServerDraining):
        return grpc.StatusCode.UNAVAILABLE, str(exc) or type(exc).__name__
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def mapped_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn exceptions of a (streaming) handler into gRPC statuses via ``status_for``."""

    async def fail(exc: Exception, context: grpc.aio.ServicerContext) -> None:
        code, message = status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("internal error in %s", fn.__name__)
        await context.abort(code, message)

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in fn(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await fail(exc, context)

        return stream

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await fail(exc, context)

    return unary
