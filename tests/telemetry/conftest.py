"""Fixtures: a live OTLP receiver, and this process's tracing pointed at it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services import telemetry
from services.telemetry.otlp_receiver import OtlpReceiver, otel_env


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


@pytest.fixture
def tracing(receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    """Tracing on for this process (service ``cdb-test``), exporting to ``receiver``; off again afterwards."""
    for key, value in otel_env(receiver.endpoint, "cdb-test").items():
        monkeypatch.setenv(key, value)
    telemetry.init_tracing("cdb-test")
    assert telemetry.enabled()
    yield receiver
    telemetry.shutdown_tracing()


@pytest.fixture(autouse=True)
def _tracing_off_after() -> Iterator[None]:
    yield
    telemetry.shutdown_tracing()
