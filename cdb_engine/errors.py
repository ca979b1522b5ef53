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


class EngineStopped(EngineError):
    """The engine is shutting down or has failed (gRPC UNAVAILABLE)."""
