"""Fair shares and connection timeouts of the HTTP API: a caller at its limit gets 429 naming the setting while a
caller with another key is served, and its share comes back; a client that stops reading a stream is cut and its
request aborted; request headers and bodies that do not arrive in time, and idle keep-alive connections, end; one
client host's connections are bounded (429), a configured proxy's are not."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import replace

import openai
import pytest

import services.http.server
from tests.http.harness import SETTINGS, TINY, Served, served, wait_until

pytestmark = pytest.mark.timeout(120)

LONG = {"ignore_eos": True}  # random weights may sample a stop id at once; these tests want every token


def held(s: Served) -> dict[str, tuple[int, int]]:
    return s.on_loop(s.door.shares.held)


def settled(s: Served) -> None:
    wait_until(lambda: not held(s) and not s.on_loop(lambda: len(s.door.live)), "every share to be given back")


def test_a_caller_at_its_limit_gets_429_and_another_key_is_served() -> None:
    with served(gated=True, api_keys=["key-a", "key-b"], settings=replace(SETTINGS, max_requests_per_caller=1)) as s:
        assert s.gate is not None
        a, b = s.client("key-a"), s.client("key-b")
        first = a.completions.create(model="ouro-tiny", prompt="a", max_tokens=3, stream=True, extra_body=LONG)
        with pytest.raises(openai.RateLimitError) as err:  # admitted requests are held at their first stage op
            a.chat.completions.create(model="ouro-tiny", messages=[{"role": "user", "content": "more"}], max_tokens=2)
        assert err.value.code == "rate_limit_exceeded" and "CDB_MAX_REQUESTS_PER_CALLER" in err.value.message
        other = b.completions.create(model="ouro-tiny", prompt="b", max_tokens=3, stream=True, extra_body=LONG)
        assert sorted(held(s).values()) == [(1, 1), (1, 1)]  # B was admitted beside A
        s.gate.set()
        for stream in (first, other):
            chunks = list(stream)
            assert chunks[-1].choices[0].finish_reason == "length"
        settled(s)
        out = a.completions.create(model="ouro-tiny", prompt="again", max_tokens=2, extra_body=LONG)
        assert out.usage is not None and out.usage.completion_tokens == 2


def test_without_keys_the_client_host_is_the_caller() -> None:
    with served(gated=True, settings=replace(SETTINGS, max_streams_per_caller=1)) as s:
        assert s.gate is not None
        client = s.client()
        first = client.completions.create(model="ouro-tiny", prompt="a", max_tokens=2, stream=True, extra_body=LONG)
        assert held(s) == {"peer-127.0.0.1": (1, 1)}
        status, headers, body = s.request(
            "POST", "/v1/completions", {"model": "ouro-tiny", "prompt": "b", "max_tokens": 2, "stream": True}
        )
        error = json.loads(body)["error"]
        assert status == 429 and error["code"] == "rate_limit_exceeded" and headers["retry-after"] == "1"
        assert "CDB_MAX_STREAMS_PER_CALLER" in error["message"]
        s.gate.set()
        assert list(first)[-1].choices[0].finish_reason == "length"
        settled(s)


@pytest.mark.parametrize("proxies", ["", "127.0.0.1"])
def test_a_forwarded_client_address_names_the_caller_only_from_a_configured_proxy(proxies: str) -> None:
    """By default a client cannot name its own caller (and so escape its share) with ``X-Forwarded-For``; behind
    a proxy listed in ``CDB_FORWARDED_ALLOW_IPS`` the forwarded address is the caller."""
    settings = replace(SETTINGS, max_streams_per_caller=1, forwarded_allow_ips=proxies)
    with served(gated=True, settings=settings) as s:
        assert s.gate is not None
        body = {"model": "ouro-tiny", "prompt": "a", "max_tokens": 2, "stream": True, **LONG}
        first = s.client().completions.create(model="ouro-tiny", prompt="a", max_tokens=2, stream=True, extra_body=LONG)
        got: list[int] = []
        second = threading.Thread(
            target=lambda: got.append(
                s.request("POST", "/v1/completions", body, headers={"X-Forwarded-For": "203.0.113.9"})[0]
            )
        )
        second.start()
        if proxies:  # admitted as another caller (held at its first stage op until the gate opens)
            wait_until(lambda: set(held(s)) == {"peer-127.0.0.1", "peer-203.0.113.9"}, "the second caller's share")
        else:
            second.join(30)
            assert got == [429] and set(held(s)) == {"peer-127.0.0.1"}
        s.gate.set()
        second.join(30)
        assert got == [200 if proxies else 429]
        assert list(first)[-1].choices[0].finish_reason == "length"
        settled(s)


def test_connections_past_the_cap_get_503_at_once() -> None:
    with served(settings=replace(SETTINGS, http_max_connections=2)) as s:
        host, port = s.address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]
        try:
            wait_until(lambda: s.request("GET", "/health")[0] == 503, "the third connection to be refused")
        finally:
            for sock in idle:
                sock.close()
        wait_until(lambda: s.request("GET", "/health")[0] == 200, "serving again once they closed")


def test_a_peers_connections_past_its_limit_get_429_and_a_configured_proxys_do_not() -> None:
    for proxies in ("", "127.0.0.1"):
        with served(settings=replace(SETTINGS, http_max_connections_per_peer=2, forwarded_allow_ips=proxies)) as s:
            host, port = s.address.rsplit(":", 1)
            idle = [socket.create_connection((host, int(port))) for _ in range(2)]  # (accepted in order)
            try:
                status, _, body = s.request("GET", "/health")
                if proxies:  # a proxy carries many clients: its connections are not bounded per peer
                    assert status == 200
                    continue
                assert status == 429
                error = json.loads(body)["error"]
                assert error["code"] == "rate_limit_exceeded"
                assert "CDB_HTTP_MAX_CONNECTIONS_PER_PEER" in error["message"]
            finally:
                for sock in idle:
                    sock.close()
            wait_until(lambda: s.request("GET", "/health")[0] == 200, "serving it again once it closed some")


@pytest.fixture
def small_send_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's sockets buffer 8 KiB instead of up to 4 MiB: a client that reads nothing blocks the server's
    writes after a few hundred tokens instead of thousands."""
    listen = services.http.server._listen

    def small(address: str, reuse_port: bool = False) -> socket.socket:
        sock = listen(address, reuse_port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted connections inherit it
        return sock

    monkeypatch.setattr(services.http.server, "_listen", small)


def connect(s: Served, rcvbuf: int | None = None) -> socket.socket:
    host, port = s.address.rsplit(":", 1)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((host, int(port)))
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def post(path: str, body: bytes, length: int | None = None) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(body) if length is None else length}\r\n\r\n".encode() + body


@pytest.mark.usefixtures("small_send_buffers")
def test_a_client_that_stops_reading_a_stream_is_cut_and_its_request_aborted() -> None:
    settings = replace(SETTINGS, stream_stall_timeout_s=0.5)
    with served(replace(TINY, max_total_tokens=4096), settings=settings) as s:
        request = {"model": "ouro-tiny", "prompt": "hello", "max_tokens": 3000, "stream": True, "logprobs": 20}
        with connect(s, rcvbuf=4096) as sock:
            sock.sendall(post("/v1/completions", json.dumps({**request, **LONG}).encode()))
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            wait_until(lambda: bool(held(s)), "the request to be admitted")
            # no more reading: the buffers fill, the server's writes wait, the stall timeout cuts the connection
            settled(s)
            # the request was aborted, not left to finish: the engine thread applies the abort a moment after the
            # share is given back (its id is free at once), well before 3000 tokens could be generated
            wait_until(lambda: (st := s.engine.stats()).running + st.waiting == 0, "the abort to be applied", 5.0)
            assert s.engine.sched_stats.tokens < 3000
            assert not read_to_end(sock).endswith(b"data: [DONE]\n\n")


def test_heads_bodies_and_idle_connections_are_timed_but_slow_answers_are_not() -> None:
    timeouts = {"header_read_timeout_s": 0.2, "body_read_timeout_s": 0.2, "http_keep_alive_s": 0.2}
    with served(gated=True, settings=replace(SETTINGS, **timeouts)) as s:
        assert s.gate is not None
        with connect(s) as silent:  # connects and sends nothing
            assert read_to_end(silent) == b""
        with connect(s) as trickle:  # half a request head
            trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
            assert read_to_end(trickle) == b""
        with connect(s) as slow_body:  # a complete head, 10 of 100 body bytes
            slow_body.sendall(post("/v1/completions", b'{"prompt":', length=100))
            reply = read_to_end(slow_body)  # the 408, then the connection closes
            assert reply.startswith(b"HTTP/1.1 408") and b"CDB_BODY_READ_TIMEOUT_S" in reply
            assert b'"code":"request_timeout"' in reply
        with connect(s) as patient:
            body = json.dumps({"model": "ouro-tiny", "prompt": "hi", "max_tokens": 2, **LONG}).encode()
            patient.sendall(post("/v1/completions", body))
            wait_until(lambda: bool(held(s)), "the request to be admitted")
            time.sleep(0.4)  # the scenario, not a synchronisation: the answer takes longer than the head timeout
            s.gate.set()
            reply = read_to_end(patient)  # the answer, then the idle keep-alive connection is closed
            assert reply.startswith(b"HTTP/1.1 200") and b'"completion_tokens":2' in reply


def test_a_request_head_over_the_limit_gets_431_and_the_port_keeps_serving() -> None:
    from services.http.protocol import MAX_HEAD_BYTES

    with served() as s:
        with connect(s) as big:
            padding = b"x" * (MAX_HEAD_BYTES + 1)
            big.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-Pad: " + padding + b"\r\n\r\n")
            reply = read_to_end(big)  # the 431, then the connection closes
            assert reply.startswith(b"HTTP/1.1 431") and str(MAX_HEAD_BYTES).encode() in reply
        with connect(s) as ok:  # a head just under the limit is served
            padding = b"x" * (MAX_HEAD_BYTES - 200)
            ok.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nConnection: close\r\nX-Pad: " + padding + b"\r\n\r\n")
            assert read_to_end(ok).startswith(b"HTTP/1.1 200")


def test_a_request_head_that_never_ends_is_refused_once_over_the_limit() -> None:
    from services.http.protocol import MAX_HEAD_BYTES

    with served() as s, connect(s) as endless:
        start = b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-Pad: "
        # one byte over the limit, in pieces, and no end of the head: the server has read all of it when it refuses
        # (so it closes without unread bytes, which would reset the connection before the reply is read)
        left = MAX_HEAD_BYTES + 1 - len(start)
        endless.sendall(start)
        while left:
            piece = min(left, 4096)
            endless.sendall(b"y" * piece)
            left -= piece
        assert read_to_end(endless).startswith(b"HTTP/1.1 431")
