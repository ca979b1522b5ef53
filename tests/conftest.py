"""Fixtures shared across test packages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from clients.sync_client import Client
from tests.services.tree import IDLE, SharedTree, traced_process_tree, wait_idle


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
