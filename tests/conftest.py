"""Fixtures shared across test packages."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from cdb_engine.config import EngineConfig
from clients.sync_client import Client
from tests.http.tree import http_process_tree
from tests.services.tree import IDLE, SHARED_CONFIG, SharedTree, traced_process_tree, wait_idle


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread for the models the tests run in this process: their tensors are tiny, so a second
    thread only adds synchronisation (on two cores, about a fifth of the in-process engine tests' time, and the
    other core is mypy's or a process tree's). The processes the tests start set their own."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def _ouro_tiny_session_tree() -> Iterator[SharedTree]:
    with traced_process_tree() as tree:
        yield tree


@pytest.fixture
def ouro_tiny_tree(_ouro_tiny_session_tree: SharedTree) -> Iterator[SharedTree]:
    """The process tree of ``SHARED_CONFIG``, started once per session (with tracing and metrics on) for every
    test that leaves it as it found it: healthy, with nothing waiting, running or held afterwards (checked)."""
    tree = _ouro_tiny_session_tree
    yield tree
    with Client(tree.address, timeout=30) as client:
        assert wait_idle(client) == IDLE, "the test left requests in the shared tree"
        assert client.health() == "SERVING", "the test left the shared tree unhealthy"


@pytest.fixture(scope="session")
def shared_http_tree() -> Iterator[tuple[str, str]]:
    """A process tree of ``SHARED_CONFIG`` (replayed depths allowed) with the HTTP API on a free port, started once
    per session for the tests that need both APIs: its gRPC address and the API's base URL."""
    with http_process_tree(replace(SHARED_CONFIG, allow_replay_depths=True)) as (handle, base_url):
        yield handle.address, base_url


KJV_HTTP = EngineConfig(model="ouro-kjv", max_num_seqs=8, num_kv_blocks=512, max_waiting=64)


@pytest.fixture(scope="session")
def kjv_http_tree() -> Iterator[str]:
    """A process tree of the shipped model (``KJV_HTTP``, float32) with the HTTP API, started once per session for
    the tests that use the model through the deployment (the OpenAI client, the evaluation harness): the API's
    base URL (``.../v1``)."""
    with http_process_tree(KJV_HTTP) as (_, base_url):
        yield base_url
