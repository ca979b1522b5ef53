"""Typed caller errors. The service maps them to gRPC status codes in one place."""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's errors."""


class InvalidRequest(EngineError, ValueError):
    """The request breaks a rule or a limit (gRPC INVALID_ARGUMENT). ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class Overloaded(EngineError):
    """The waiting queue or the concurrency cap is full (gRPC RESOURCE_EXHAUSTED)."""


class CallerLimit(EngineError):
    """The caller is at one of its limits (``services.api.shares``: counted by a front door, or by the scheduler
    for every front end of a tree); the message names the setting (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""


class EngineStopped(EngineError):
    """The engine is shutting down or has failed (gRPC UNAVAILABLE)."""
