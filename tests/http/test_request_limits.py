"""The HTTP API bounds what a caller sends before doing work for it: bodies over ``CDB_MAX_REQUEST_BYTES`` get 413
before they are parsed or their API key is checked, declared or streamed; the original ``top_k`` overflow is a 400
naming the field and leaves the engine serving; tokenization and chat-template rendering run off the event loop."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from dataclasses import replace
from typing import Any

import pytest

from services.http.body_limit import BodyLimit
from tests.http.harness import SETTINGS, Served, served

pytestmark = pytest.mark.timeout(120)

LIMIT = 4096
SMALL = replace(SETTINGS, max_request_bytes=LIMIT)


def chunked_post(s: Served, path: str, chunks: list[bytes], headers: dict[str, str]) -> tuple[int, bytes]:
    """A POST whose body is sent chunked (no Content-Length): the limit must hold while it streams in."""
    host, port = s.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=iter(chunks), headers=headers)  # an iterator: sent chunked
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_body_over_the_limit_gets_413_before_its_api_key_is_checked() -> None:
    with served(settings=SMALL, api_keys=["k"]) as s:
        big = {"model": "ouro-tiny", "prompt": "x" * LIMIT, "max_tokens": 2}
        status, _, body = s.request("POST", "/v1/completions", big)  # no key: still 413, not 401
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        status, body = chunked_post(
            s, "/v1/completions", [b'{"prompt": "', b"y" * LIMIT, b'"}'], {"Content-Type": "application/json"}
        )
        assert status == 413 and b"CDB_MAX_REQUEST_BYTES" in body
        status, _, _ = s.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 401  # within the limit the key is checked as before
        ok = {"model": "ouro-tiny", "prompt": "hi", "max_tokens": 2}
        status, _, body = s.request("POST", "/v1/completions", ok, headers={"Authorization": "Bearer k"})
        assert status == 200, body


def test_a_body_within_the_limit_reaches_the_app_whole_even_when_chunked() -> None:
    with served(settings=SMALL) as s:
        body = json.dumps({"model": "ouro-tiny", "prompt": "hello", "max_tokens": 2}).encode()
        chunks = [body[i : i + 7] for i in range(0, len(body), 7)]
        status, reply = chunked_post(s, "/v1/completions", chunks, {"Content-Type": "application/json"})
        assert status == 200 and json.loads(reply)["usage"]["completion_tokens"] == 2


def test_the_body_limit_middleware_refuses_a_declared_length_without_reading_the_body() -> None:
    sent: list[dict[str, object]] = []

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("the app ran")

    async def receive() -> dict[str, object]:
        raise AssertionError("the body was read")

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", b"9" * 40)]}
    asyncio.run(BodyLimit(app, 10)(scope, receive, send))  # type: ignore[arg-type]
    assert sent[0]["status"] == 413


def test_top_k_beyond_int32_is_a_400_naming_it_and_the_engine_keeps_serving() -> None:
    with served() as s:
        status, _, body = s.request(
            "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 2147483648, "temperature": 1}
        )
        assert status == 400 and json.loads(body)["error"]["param"] == "top_k"
        status, _, body = s.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": -1})
        assert status == 400 and json.loads(body)["error"]["param"] == "seed"
        status, _, body = s.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 5})
        assert status == 200 and s.engine.stats().healthy


def test_tokenization_and_chat_templates_run_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    with served() as s:
        threads: list[str] = []
        tokenizer = s.engine.tokenizer
        encode, template = tokenizer.encode, tokenizer.apply_chat_template

        def spy_encode(text: str) -> list[int]:
            threads.append(threading.current_thread().name)
            return encode(text)

        def spy_template(messages: list[dict[str, str]], add_generation_prompt: bool = True, **kw: Any) -> list[int]:
            threads.append(threading.current_thread().name)
            return template(messages, add_generation_prompt, **kw)

        monkeypatch.setattr(tokenizer, "encode", spy_encode)
        monkeypatch.setattr(tokenizer, "apply_chat_template", spy_template)
        status, _, _ = s.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, _, _ = s.request("POST", "/v1/chat/completions", chat)
        assert status == 400  # ouro-tiny's byte tokenizer has no chat template: refused by the template call
        assert len(threads) == 2 and s.thread.name not in threads
