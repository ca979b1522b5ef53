"""The process tree with two front-end processes (``CDB_FRONTENDS=2``) sharing the public ports: results equal the
in-process engine over gRPC and HTTP, request metrics reach the scheduler's endpoint, and a front end killed
mid-stream is restarted while its streams resume on the other one and nothing stays held; a request's trace runs
from the front end's span through the scheduler's engine span to the stage hops. Hardening: a caller's share counts
once over both front ends; a stopped scheduler is answered 503 within seconds and served again once it resumes;
the front ends hold the link's secret, never the stage secret."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdb_engine.config import RequestParams
from cdb_engine.engine import Engine
from cdb_scheduler.sampling import SamplingParams
from clients.messages import GenerateOptions
from clients.sync_client import Client
from services.frontlink.messages import LinkError
from services.frontlink.wire import Wire, client_handshake, connect_unix, socket_path
from services.launcher.commands import FRONTEND_PREFIX
from services.launcher.supervisor import ServeHandle
from services.launcher.tree import serve_all
from services.stage_secret import link_secret, load_stage_secret
from services.telemetry.otlp_receiver import CollectedSpan, OtlpReceiver, children, descendants, one
from tests.services.tree import IDLE, SHARED_CONFIG, TEST_ENV, StreamRun, free_port, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SHARE = 8  # live requests of one caller (every test's client is the one host)
LINK_TIMEOUT_S = 1.0


class Tree:
    def __init__(self, handle: ServeHandle, http: str, metrics: str, receiver: OtlpReceiver) -> None:
        self.handle, self.http, self.metrics, self.receiver = handle, http, metrics, receiver

    def scrape(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def tree() -> Iterator[Tree]:
    http, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    with OtlpReceiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(TEST_ENV, CDB_FRONTENDS="2", CDB_HTTP_ADDR=http)
        env.update(CDB_MAX_REQUESTS_PER_CALLER=str(SHARE), CDB_LINK_TIMEOUT_S=str(LINK_TIMEOUT_S))
        env.update(
            OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="100"
        )
        handle = serve_all(SHARED_CONFIG, "127.0.0.1:0", env=env, metrics_listen=metrics)
        try:
            yield Tree(handle, http, metrics, receiver)
        finally:
            handle.stop(drain_timeout=5.0)


def test_a_request_trace_spans_front_end_engine_and_stage_hops(tree: Tree) -> None:
    with Client(tree.handle.address, timeout=60) as client:
        client.generate([5, 6, 7, 8], max_tokens=4, request_id="traced-1")

    def complete(spans: list[CollectedSpan]) -> bool:
        reqs = [s for s in spans if s.attributes.get("cdb.request_id") == "traced-1"]
        return bool(reqs) and any(s.name == "decode" for s in descendants(spans, reqs[0]))

    spans = tree.receiver.wait_for(complete, timeout=30)
    (req,) = [s for s in spans if s.attributes.get("cdb.request_id") == "traced-1"]  # the front end's span only
    assert req.resource.get("service.name") == "cdb-frontend"
    engine = one(children(spans, req), f"engine {SHARED_CONFIG.model}")
    below = {s.name for s in descendants(spans, engine)}
    assert {"queue", "prefill", "decode", "hop prelude", "hop loop", "hop head"} <= below


def _requests(n: int, seed: int) -> list[tuple[list[int], GenerateOptions]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]
        opts = GenerateOptions(max_tokens=rng.randrange(5, 40), ignore_eos=True)
        if i % 2:
            opts.update(temperature=0.9, top_p=0.9, seed=100 + i)
        out.append((prompt, opts))
    return out


def _expected(requests: list[tuple[list[int], GenerateOptions]]) -> list[tuple[list[int], list[int]]]:
    params = [
        RequestParams(
            max_tokens=o["max_tokens"],
            ignore_eos=True,
            sampling=SamplingParams(
                temperature=o.get("temperature", 0.0), top_p=o.get("top_p", 1.0), seed=o.get("seed", 0)
            ),
        )
        for _, o in requests
    ]
    with Engine(SHARED_CONFIG) as local:
        return [(c.token_ids, c.depths) for c in local.generate([p for p, _ in requests], params)]


def test_tokens_http_and_metrics_through_two_front_ends(tree: Tree) -> None:
    assert len(tree.handle.frontends) == 2
    requests = _requests(10, seed=5)
    expected = _expected(requests)
    tokens_before = tree.scrape("cdb_generation_tokens_total")
    clients = [Client(tree.handle.address, timeout=60) for _ in range(5)]  # connections spread over both
    try:
        info = clients[0].info()
        assert info.deployment == "microservices" and info.model == "ouro-tiny" and info.healthy
        assert clients[1].health() == "SERVING"
        runs = [StreamRun(clients[i % 5], p, o).start() for i, (p, o) in enumerate(requests[::2])]
        unary = [clients[(i + 2) % 5].generate(p, **o) for i, (p, o) in enumerate(requests[1::2])]
        for run in runs:
            assert run.done.wait(60) and run.error is None
        got: list[tuple[list[int], list[int]]] = [([], [])] * len(requests)
        got[::2] = [([t.id for t in r.tokens], [t.depth for t in r.tokens]) for r in runs]
        got[1::2] = [(u.token_ids, u.depths) for u in unary]
        assert got == expected
        body = {"model": "ouro-tiny", "prompt": requests[0][0], "max_tokens": requests[0][1]["max_tokens"]}
        call = urllib.request.Request(
            f"http://{tree.http}/v1/completions",
            data=json.dumps({**body, "ignore_eos": True, "temperature": 0}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(call, timeout=60) as reply:
            assert reply.status == 200
            assert json.loads(reply.read())["choices"][0]["cdb"]["depths"] == expected[0][1]
        assert wait_idle(clients[0]) == IDLE
    finally:
        for c in clients:
            c.close()
    generated = sum(len(ids) for ids, _ in expected) + len(expected[0][0])
    counted = tokens_before + generated  # relayed within the front ends' flush period
    _poll(lambda: tree.scrape("cdb_generation_tokens_total") >= counted, "relayed token counts")
    assert tree.scrape("cdb_generation_tokens_total") == counted


def _poll(cond: object, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)  # the front ends relay metrics every 50 ms: no event to wait on


def test_a_killed_front_end_is_restarted_and_its_streams_resume(tree: Tree) -> None:
    requests = _requests(6, seed=9)
    for _, o in requests:
        o["max_tokens"] = 120
    expected = _expected(requests)
    clients = [Client(tree.handle.address, timeout=60) for _ in range(6)]
    try:
        runs = [StreamRun(clients[i], p, o).start() for i, (p, o) in enumerate(requests)]
        for run in runs:
            assert run.first.wait(60)
        victim = tree.handle.frontends[0]
        os.kill(victim.pid, signal.SIGKILL)
        for run in runs:
            assert run.done.wait(90) and run.error is None, run.error
        assert [([t.id for t in r.tokens], [t.depth for t in r.tokens]) for r in runs] == expected
        _poll(lambda: any(r.name == f"{FRONTEND_PREFIX}0" for r in tree.handle.restarts), "front end 0 restarted")
        _poll(lambda: os.path.exists(os.path.join(tree.handle.workdir, f"{FRONTEND_PREFIX}0.ready")), "ready again")
        assert wait_idle(clients[0]) == IDLE
    finally:
        for c in clients:
            c.close()
    with Client(tree.handle.address, timeout=60) as fresh:
        assert fresh.generate("after", max_tokens=3).finish.generated_tokens == 3


def test_a_callers_share_counts_once_over_two_front_ends(tree: Tree) -> None:
    """Twice its share of HTTP streams from one caller, a connection each (the kernel spreads them over both front
    ends, each of which would admit a whole share on its own): exactly a share admitted, the rest refused 429."""
    host, port = tree.http.rsplit(":", 1)
    body = {"model": "ouro-tiny", "prompt": "a", "max_tokens": 390, "ignore_eos": True, "stream": True}
    conns = [http.client.HTTPConnection(host, int(port), timeout=60) for _ in range(2 * SHARE)]
    try:
        replies = []
        for conn in conns:  # each stays live (390 tokens, seconds here) until all are answered
            conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
            replies.append(conn.getresponse())
        assert sorted(r.status for r in replies) == [200] * SHARE + [429] * SHARE
        for reply in replies:
            if reply.status == 429:
                assert "CDB_MAX_REQUESTS_PER_CALLER" in json.loads(reply.read())["error"]["message"]
    finally:
        for conn in conns:
            conn.close()
    with Client(tree.handle.address, timeout=60) as fresh:
        assert wait_idle(fresh) == IDLE
        assert fresh.generate("after", max_tokens=3).finish.generated_tokens == 3, "the shares came back"


def _health(tree: Tree) -> int:
    try:
        with urllib.request.urlopen(f"http://{tree.http}/health", timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_stopped_scheduler_is_answered_503_within_seconds_and_served_again(tree: Tree) -> None:
    scheduler = tree.handle.scheduler
    assert scheduler is not None
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        _poll(lambda: _health(tree) == 503, "the front ends' health to say 503", timeout=LINK_TIMEOUT_S + 5)
        assert time.monotonic() - stopped < LINK_TIMEOUT_S + 3
        body = json.dumps({"model": "ouro-tiny", "prompt": "x", "max_tokens": 2}).encode()
        call = urllib.request.Request(
            f"http://{tree.http}/v1/completions", data=body, headers={"content-type": "application/json"}
        )
        asked = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(call, timeout=30)
        assert err.value.code == 503 and time.monotonic() - asked < LINK_TIMEOUT_S + 2
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    _poll(lambda: _health(tree) == 200, "the front ends to be ready again", timeout=30)
    with Client(tree.handle.address, timeout=60) as client:
        assert client.generate("again", max_tokens=3).finish.generated_tokens == 3


def test_the_front_ends_hold_the_links_secret_not_the_stage_secret(tree: Tree) -> None:
    stage_secret = load_stage_secret(tree.handle.settings)
    for proc in tree.handle.frontends:
        argv = Path(f"/proc/{proc.pid}/cmdline").read_text().split("\0")
        document = json.loads(Path(argv[argv.index("--resolved-config") + 1]).read_text())["settings"]
        assert document["stage_secret"] == document["stage_secret_file"] == ""
        assert Path(document["link_secret_file"]).read_text().strip() == link_secret(stage_secret)
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().decode(errors="replace")
        assert "CDB_STAGE_SECRET" not in environ and stage_secret not in environ
    link = socket_path(f"unix:{tree.handle.workdir}/link.sock")
    wire = Wire(connect_unix(link))
    try:
        with pytest.raises((LinkError, OSError)):  # the stage secret is not the link's
            client_handshake(wire, stage_secret.encode())
    finally:
        wire.close()
