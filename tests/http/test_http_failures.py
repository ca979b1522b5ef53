"""API keys, overload, unavailability, drain and disconnects of the HTTP API, each on its own server.

Stage ops are held by a gated executor where a test needs requests that are admitted but make no progress.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from cdb_engine.client import InProcessClient
from cdb_engine.engine import Engine
from services.api.door import FrontDoor
from services.http.app import serve_api
from services.http.errors import param_of
from tests.http.harness import SETTINGS, TINY, Served, served, wait_until
from tests.services.tree import free_port

pytestmark = pytest.mark.timeout(120)

LONG = {"ignore_eos": True}  # random weights may sample a stop id at once; these tests want every token


def drain(s: Served, timeout: float) -> asyncio.Future:
    """The scheduler's drain (``services.api.server.serve``) run on the server's loop: refuse new work, wait
    up to ``timeout`` s for in-flight requests, then cut the rest. Resolves to "idle" or "cut"."""
    door = s.door

    async def run() -> str:
        door.draining = True
        try:
            await asyncio.wait_for(door.idle.wait(), timeout)
            return "idle"
        except TimeoutError:
            door.cut = True
            door.abort_all()
            await door.idle.wait()
            return "cut"

    return asyncio.run_coroutine_threadsafe(run(), s.loop)  # type: ignore[return-value]


def test_api_keys_from_the_settings_are_required_except_for_health_and_metrics(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# operators\nfile-key\n")
    settings = replace(SETTINGS, api_keys="env-key", api_keys_file=str(keys_file))
    with served(settings=settings) as s:
        with pytest.raises(openai.AuthenticationError) as err:
            s.client(api_key="wrong").completions.create(model="ouro-tiny", prompt="hi", max_tokens=2)
        assert err.value.code == "invalid_api_key"
        for headers in ({}, {"Authorization": "Basic env-key"}, {"Authorization": "Bearer"}):
            status, got, body = s.request("GET", "/v1/models", headers=headers)
            assert status == 401 and got["www-authenticate"] == "Bearer"
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
        status, _, _ = s.request("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"})
        assert status == 401  # the key is checked before the body
        for key in ("env-key", "file-key"):
            client = s.client(api_key=key)
            out = client.completions.create(model="ouro-tiny", prompt="hi", max_tokens=2, extra_body=LONG)
            assert out.usage is not None and out.usage.completion_tokens == 2
        assert s.request("GET", "/health")[0] == 200
        assert s.request("GET", "/metrics")[0] == 200


def test_overload_is_429_at_once_and_admitted_requests_still_finish() -> None:
    one_caller_may_overload = replace(SETTINGS, max_requests_per_caller=8)  # (by default: half the server)
    with served(replace(TINY, max_num_seqs=1, max_waiting=1), gated=True, settings=one_caller_may_overload) as s:
        client = s.client()
        assert s.gate is not None
        held = [
            client.completions.create(prompt=f"held {i}", model="ouro-tiny", max_tokens=3, stream=True, extra_body=LONG)
            for i in range(2)
        ]  # admitted (headers sent), held at their first stage op
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model="ouro-tiny", prompt="one too many", max_tokens=2)
        assert err.value.code == "overloaded" and err.value.response.headers["retry-after"] == "1"
        assert s.door.metrics.rejected.value("RESOURCE_EXHAUSTED") == 1
        s.gate.set()
        for stream in held:
            chunks = list(stream)
            assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) == 4
        out = client.completions.create(model="ouro-tiny", prompt="fits again", max_tokens=2, extra_body=LONG)
        assert out.usage is not None and out.usage.completion_tokens == 2


def test_an_engine_that_is_not_running_is_503_on_health_and_requests() -> None:
    with served(start_engine=False) as s:
        status, _, body = s.request("GET", "/health")
        assert status == 503 and json.loads(body) == {"status": "not_serving", "reason": "engine stopped"}
        with pytest.raises(openai.InternalServerError) as err:
            s.client().completions.create(model="ouro-tiny", prompt="hi", max_tokens=2)
        assert err.value.status_code == 503 and err.value.code == "unavailable"


def test_a_stage_down_is_503_naming_it() -> None:
    with served() as s:
        broken = SimpleNamespace(executor=SimpleNamespace(broken="loop stage lost (connection reset)"))
        s.on_loop(lambda: setattr(s.door, "factory", broken))
        status, _, body = s.request("GET", "/health")
        assert status == 503 and json.loads(body)["reason"] == "loop stage lost (connection reset)"
        with pytest.raises(openai.InternalServerError) as err:
            s.client().completions.create(model="ouro-tiny", prompt="hi", max_tokens=2)
        assert err.value.status_code == 503 and "loop stage lost" in err.value.message
        s.on_loop(lambda: setattr(s.door, "factory", None))


def test_a_drain_waits_for_http_streams_refuses_new_ones_and_cuts_the_rest_at_its_deadline() -> None:
    with served(gated=True) as s:
        client = s.client()
        assert s.gate is not None
        stream = client.completions.create(model="ouro-tiny", prompt="a", max_tokens=3, stream=True, extra_body=LONG)
        drained = drain(s, timeout=60)
        wait_until(lambda: s.request("GET", "/health")[0] == 503, "health to say draining")
        assert json.loads(s.request("GET", "/health")[2])["reason"] == "draining"
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="ouro-tiny", prompt="too late", max_tokens=2)
        assert err.value.status_code == 503 and "shutting down" in err.value.message
        assert not drained.done()  # the HTTP stream is in flight (its ops are held)
        s.gate.set()
        assert list(stream)[-1].choices[0].finish_reason == "length"
        assert drained.result(30) == "idle"

        s.gate.clear()
        s.on_loop(lambda: setattr(s.door, "draining", False))
        stream = client.completions.create(model="ouro-tiny", prompt="b", max_tokens=3, stream=True, extra_body=LONG)
        drained = drain(s, timeout=0.2)  # the drain deadline passes while the stream's ops are held
        wait_until(lambda: s.door.cut, "the drain deadline")
        s.gate.set()
        with pytest.raises(openai.APIError, match="shut down before the request finished"):
            list(stream)
        assert drained.result(30) == "cut"


def test_a_client_that_disconnects_aborts_its_request() -> None:
    with served(gated=True) as s:
        assert s.gate is not None
        host, port = s.address.rsplit(":", 1)
        body = json.dumps({"prompt": "bye", "max_tokens": 300, **LONG}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        with socket.create_connection((host, int(port))) as sock:  # non-streamed
            sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_until(lambda: len(s.door.live) == 1, "the request to be admitted")
        wait_until(lambda: not s.door.live, "the request to be dropped")

        stream = s.client().completions.create(
            model="ouro-tiny", prompt="bye", max_tokens=300, stream=True, extra_body=LONG
        )
        assert len(s.door.live) == 1
        stream.close()
        wait_until(lambda: not s.door.live, "the streamed request to be dropped")
        s.gate.set()
        wait_until(lambda: s.engine.stats().running + s.engine.stats().waiting == 0, "the engine to be idle")
        assert s.door.metrics.finished.value("cancelled") == 2
        assert s.door.metrics.generated_tokens.value() < 600


def test_stopping_the_server_closes_the_listener_and_lets_a_stream_finish() -> None:
    with served(gated=True) as s:
        assert s.gate is not None
        stream = s.client().completions.create(
            model="ouro-tiny", prompt="a", max_tokens=3, stream=True, extra_body=LONG
        )
        s.stop()
        host, port = s.address.rsplit(":", 1)

        def refused() -> bool:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
            except ConnectionRefusedError:
                return True
            except ConnectionResetError:  # taken into the backlog as the listener closed: ask again
                return False
            return False

        wait_until(refused, "the listener to close")
        s.gate.set()
        assert list(stream)[-1].choices[0].finish_reason == "length"
        s.thread.join(30)
        assert not s.thread.is_alive()


def test_stopping_cuts_a_stream_that_outlives_the_shutdown_timeout() -> None:
    with served(gated=True, shutdown_timeout_s=1.0) as s:
        stream = s.client().completions.create(
            model="ouro-tiny", prompt="a", max_tokens=3, stream=True, extra_body=LONG
        )
        s.stop()
        s.thread.join(30)  # uvicorn cancels the response after 1 s, which aborts the request
        assert not s.thread.is_alive()
        assert not s.door.live and s.door.idle.is_set()
        with pytest.raises(openai.APIConnectionError):
            list(stream)


def test_serve_api_serves_on_the_settings_address_until_cancelled() -> None:
    """What the scheduler runs: ``serve_api`` as a task beside its gRPC server, cancelled after the drain."""
    settings = replace(SETTINGS, http_addr=f"127.0.0.1:{free_port()}")
    host, port = settings.http_addr.rsplit(":", 1)

    async def main(engine: Engine) -> tuple[str, str | None]:
        door = FrontDoor(InProcessClient(engine), settings)
        bound: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve_api(door, settings, on_bound=bound.set_result))
        address = await bound
        client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="none", max_retries=0)
        out = await asyncio.to_thread(
            client.completions.create, model="ouro-tiny", prompt="hi", max_tokens=2, extra_body=LONG
        )
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return address, out.choices[0].finish_reason

    with Engine(TINY) as engine:
        address, finish = asyncio.run(main(engine))
    assert address == settings.http_addr and finish == "length"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5).close()


def test_pydantic_locations_become_field_paths() -> None:
    assert param_of(("body", "messages", 0, "content")) == "messages[0].content"
    assert param_of(("body", "temperature")) == "temperature"
    assert param_of(("body",)) == ""
