"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status of the cause.

The cause is classified once, by the public API's status map (``services.api.errors.status_for``); this
module only turns that gRPC status into an HTTP status and names the field in this API's terms.

| cause | HTTP | ``type`` | ``code`` |
|---|---|---|---|
| ``InvalidRequest``, a body that does not parse or has a wrong type | 400 | ``invalid_request_error`` | null |
| missing or wrong API key | 401 | ``invalid_request_error`` | ``invalid_api_key`` |
| ``model`` is not the served model | 404 | ``invalid_request_error`` | ``model_not_found`` |
| ``Overloaded`` (waiting queue full) | 429 | ``rate_limit_error`` | ``overloaded`` |
| ``CallerLimit`` (the caller's own limits, ``shares``) | 429 | ``rate_limit_error`` | ``rate_limit_exceeded`` |
| a body not received within ``CDB_BODY_READ_TIMEOUT_S`` | 408 | ``invalid_request_error`` | ``request_timeout`` |
| ``StageFailed``, ``EngineStopped``, ``ServerDraining`` | 503 | ``server_error`` | ``unavailable`` |
| anything else (logged, never a traceback to the client) | 500 | ``server_error`` | ``internal_error`` |
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from cdb_engine.errors import InvalidRequest
from services.api.errors import CallerLimit, status_for

log = logging.getLogger("cdb.http")

_BY_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "unavailable"),
}


class ApiError(Exception):
    """An error reply: HTTP status and the OpenAI error object's fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def api_error(exc: BaseException, fields: Mapping[str, str] | None = None) -> ApiError:
    """The reply for an exception raised while serving a request; ``fields`` renames engine fields."""
    if isinstance(exc, ApiError):
        return exc
    code, message = status_for(exc)
    if isinstance(exc, CallerLimit):
        return ApiError(429, message, "rate_limit_error", None, "rate_limit_exceeded")
    if isinstance(exc, InvalidRequest):
        param = (fields or {}).get(exc.field, exc.field)
        return ApiError(400, f"{param}: {exc.message}", param=param)
    if code in _BY_STATUS:
        status, type_, err_code = _BY_STATUS[code]
        return ApiError(status, message, type_, None, err_code)
    log.error("internal error serving an HTTP request", exc_info=exc)
    return ApiError(500, f"internal error ({type(exc).__name__})", "server_error", None, "internal_error")


def param_of(loc: Sequence[int | str]) -> str:
    """A pydantic error location (``("body", "messages", 0, "content")``) as a field path (``messages[0].content``)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """The 400 for pydantic's errors of a request body: the first one, naming its field."""
    if not errors:
        return ApiError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg', '')}")
    param = param_of(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if not param:
        return ApiError(400, f"invalid request body: {message}")
    return ApiError(400, f"{param}: {message}", param=param)
