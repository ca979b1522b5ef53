"""``POST /tokenize`` on a real tree: a text within the body and prompt bounds but longer than ``max_model_len``
is refused naming ``prompt``, and while a 1 MiB input is tokenized (with every id's text asked for) on a worker
thread, the event loop answers health checks at once."""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

import pytest

from cdb_engine.limits import REQUEST_BOUNDS
from tests.services.tree import SHARED_CONFIG

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _post(host: str, port: int, path: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _health_s(host: str, port: int) -> float:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        t0 = time.perf_counter()
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        return time.perf_counter() - t0
    finally:
        conn.close()


def test_a_megabyte_tokenize_is_refused_by_max_model_len_and_health_does_not_wait(
    shared_http_tree: tuple[str, str],
) -> None:
    url = urlsplit(shared_http_tree[1])
    host, port = url.hostname or "127.0.0.1", url.port or 80
    status, small = _post(host, port, "/tokenize", {"prompt": "And God said", "return_token_strs": True})
    assert status == 200 and small["max_model_len"] == SHARED_CONFIG.max_total_tokens
    text = "In the beginning " * ((REQUEST_BOUNDS.max_prompt_bytes - 64) // 17)
    result: dict[str, object] = {}

    def tokenize() -> None:
        result["status"], result["body"] = _post(host, port, "/tokenize", {"prompt": text, "return_token_strs": True})

    worker = threading.Thread(target=tokenize)
    worker.start()
    waits = []
    while worker.is_alive():
        waits.append(_health_s(host, port))
    worker.join()
    assert result["status"] == 400, result
    error = result["body"]["error"]  # type: ignore[index]
    assert error["param"] == "prompt" and "max_model_len" in error["message"]
    assert waits and max(waits) < 0.5, f"health waited {max(waits):.3f} s behind the tokenizer"
