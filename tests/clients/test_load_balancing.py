"""Client-side load balancing over replicas: targets, the service config, gRPC's retry policy (on fake replicas
that count attempts), then two real replicas: the spread of one client's calls, and ``kill -9`` of one
replica's scheduler under load."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from cdb_engine.config import EngineConfig
from clients.async_client import AsyncClient
from clients.balancing import LbPolicy, RetryPolicy, channel_options, channel_target, service_config
from clients.cli import generate_main
from clients.messages import GenerateOptions, StreamToken
from clients.sync_client import Client
from services.launcher.supervisor import ServeHandle
from services.launcher.tree import serve_all
from tests.services.tree import TEST_ENV, StreamRun, free_port, wait_for_counters

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

# --- targets and the service config ---------------------------------------------------------------------------


def test_targets_for_one_address_several_ip_literals_and_dns_names() -> None:
    assert channel_target("127.0.0.1:50051") == "127.0.0.1:50051"
    assert channel_target("cdb.example:50051") == "cdb.example:50051"  # DNS: every address of the name
    assert channel_target("unix:///tmp/cdb.sock") == "unix:///tmp/cdb.sock"
    headless = "dns:///cdb-headless.default.svc:50051"
    assert channel_target(headless) == headless
    assert channel_target(" 127.0.0.1:5001 , 127.0.0.1:5002") == "ipv4:127.0.0.1:5001,127.0.0.1:5002"
    assert channel_target(["10.0.0.1:1", "10.0.0.2:2"]) == "ipv4:10.0.0.1:1,10.0.0.2:2"
    assert channel_target(["[::1]:5001", "[fe80::1]:5002"]) == "ipv6:[::1]:5001,[fe80::1]:5002"
    assert channel_target("ipv4:127.0.0.1:1,127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"  # already a target
    assert channel_target(["127.0.0.1:9"]) == "127.0.0.1:9"
    for bad, says in (
        ("a.example:1,b.example:2", "dns:///"),  # host names: no custom resolver in gRPC Python
        ("127.0.0.1:1,[::1]:2", "all be IPv4 or all IPv6"),
        ("127.0.0.1:1,127.0.0.1", "IP:PORT"),
        ("127.0.0.1:1,127.0.0.1:70000", "IP:PORT"),
        ("127.0.0.1:1,::1:2", "[IP]:PORT"),
        ("127.0.0.1:1,,127.0.0.1:2", "expected HOST:PORT"),
        ("", "expected HOST:PORT"),
    ):
        with pytest.raises(ValueError, match="address") as err:
            channel_target(bad)
        assert says in str(err.value), (bad, str(err.value))


def test_service_config_round_robin_with_a_bounded_retry_policy_for_generation() -> None:
    config = json.loads(service_config(LbPolicy.ROUND_ROBIN, RetryPolicy()))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method,) = config["methodConfig"]  # streams are resumed by the clients, not retried by gRPC
    assert method["name"] == [{"service": "cdb.v1.Generation", "method": m} for m in ("Generate", "Abort", "Info")]
    assert method["retryPolicy"] == {
        "maxAttempts": 3,
        "initialBackoff": "0.1s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2.0,
        "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
    }
    assert "methodConfig" not in json.loads(service_config("pick_first", None))
    with pytest.raises(ValueError, match="lb_policy"):
        service_config("grpclb")
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=6)
    with pytest.raises(ValueError, match="codes"):
        RetryPolicy(codes=("UNAVAILABLE", "NOT_A_CODE"))
    opts = dict(channel_options([("grpc.lb_policy_name", "pick_first"), ("grpc.keepalive_time_ms", 60_000)]))
    assert json.loads(str(opts["grpc.service_config"]))["loadBalancingConfig"] == [{"pick_first": {}}]
    assert opts["grpc.keepalive_time_ms"] == 60_000 and "grpc.lb_policy_name" not in opts  # the caller's win


# --- retries on fake replicas ---------------------------------------------------------------------------------


@dataclass
class FakeReplica(generation_pb2_grpc.GenerationServicer):
    """A ``cdb.v1.Generation`` server that counts calls. ``refuse``: abort every call with this code before any
    response; ``cut_after_token``: stream one token, then fail UNAVAILABLE."""

    refuse: grpc.StatusCode | None = None
    cut_after_token: bool = False
    calls: int = 0
    resumes: list[list[int]] = field(default_factory=list)  # GenerateRequest.resume.token_ids of each stream
    lock: threading.Lock = field(default_factory=threading.Lock)
    address: str = ""

    def _count(self, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.calls += 1
        if self.refuse is not None:
            context.abort(self.refuse, "refused by the fake")

    def GenerateStream(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[object]:
        self._count(context)
        with self.lock:
            self.resumes.append(list(request.resume.token_ids))
        if not request.resume.token_ids:  # a resumed stream continues after the tokens it had
            yield pb.GenerateStreamResponse(request_id=request.request_id, token=pb.Token(id=7, text="x", depth=2))
            if self.cut_after_token:
                context.abort(grpc.StatusCode.UNAVAILABLE, "replica lost mid-stream")
        resumed = len(request.resume.token_ids)  # (the server's usage counts them apart)
        usage = pb.Usage(generated_tokens=1 - resumed, total_loop_steps=2 - 2 * resumed, resumed_tokens=resumed)
        finish = pb.Finish(reason=pb.FINISH_REASON_LENGTH, usage=usage)
        yield pb.GenerateStreamResponse(request_id=request.request_id, finish=finish)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        self._count(context)
        finish = pb.Finish(reason=pb.FINISH_REASON_LENGTH)
        return pb.GenerateResponse(request_id=request.request_id, text="x", finish=finish)

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        self._count(context)
        return pb.InfoResponse(model="fake")


@pytest.fixture
def fakes() -> Iterator[list[FakeReplica]]:
    replicas = [FakeReplica(), FakeReplica(), FakeReplica()]
    servers = []
    for r in replicas:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        generation_pb2_grpc.add_GenerationServicer_to_server(r, server)
        r.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        servers.append(server)
    yield replicas
    for server in servers:
        server.stop(0)


FAST_RETRY = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.05)  # the default codes and attempts, less wait


def _ready(client: Client, replicas: list[FakeReplica]) -> None:
    """Every backend connected and in the round-robin rotation (each has answered a call); counts reset."""
    deadline = time.monotonic() + 10.0
    while not all(r.calls for r in replicas):
        assert time.monotonic() < deadline, f"not every fake replica was reached: {[r.calls for r in replicas]}"
        client.info(timeout=5)
    for r in replicas:
        r.calls = 0


def _ready_then(client: Client, fakes: list[FakeReplica]) -> None:
    """Connect every backend while they serve, then restore what each refuses."""
    refuse = [r.refuse for r in fakes]
    for r in fakes:
        r.refuse = None
    _ready(client, fakes)
    for r, code in zip(fakes, refuse):
        r.refuse = code


def test_round_robin_spreads_calls_and_pick_first_keeps_to_one(fakes: list[FakeReplica]) -> None:
    with Client([r.address for r in fakes], timeout=10) as client:
        _ready(client, fakes)
        for _ in range(30):
            client.generate("p")
        assert [r.calls for r in fakes] == [10, 10, 10]
    for r in fakes:
        r.calls = 0
    with Client(",".join(r.address for r in fakes), timeout=10, lb_policy="pick_first") as client:
        for _ in range(9):
            client.generate("p")
        assert sorted(r.calls for r in fakes) == [0, 0, 9]


def test_a_call_refused_before_its_first_token_is_retried_on_another_replica(fakes: list[FakeReplica]) -> None:
    fakes[0].refuse = grpc.StatusCode.UNAVAILABLE
    fakes[1].refuse = grpc.StatusCode.RESOURCE_EXHAUSTED
    with Client([r.address for r in fakes], timeout=10, retry=FAST_RETRY) as client:
        _ready_then(client, fakes)  # every replica in the rotation first: refusals while connecting could end a call
        for _ in range(12):
            items = list(client.stream("p", max_tokens=1))
            assert [type(i).__name__ for i in items] == ["StreamToken", "StreamFinish"]
            assert client.generate("p").finish.finish_reason == "length"
        assert fakes[2].calls == 24  # every call ended on the one replica that serves
        assert fakes[0].calls > 0 and fakes[1].calls > 0  # ... after refusals elsewhere
        assert fakes[0].calls + fakes[1].calls <= 2 * 24  # at most max_attempts - 1 refusals per call


def test_a_stream_that_delivered_a_token_is_resumed_elsewhere_with_it(fakes: list[FakeReplica]) -> None:
    for r in fakes:
        r.cut_after_token = True
    with Client([r.address for r in fakes], timeout=10) as client:
        _ready(client, fakes)
        run = StreamRun(client, "p", GenerateOptions(max_tokens=5), timeout=10).start()
        assert run.done.wait(15) and run.error is None, run.error
        assert [t.id for t in run.tokens] == [7]  # the token once: the resumed stream continued after it
        assert run.finish is not None and run.finish.finish_reason == "length"
        # the stream's whole counts, though the resumed attempt's server counted only its own tokens
        assert (run.finish.generated_tokens, run.finish.total_loop_steps, run.finish.resumed_tokens) == (1, 2, 1)
        assert sum(r.calls for r in fakes) == 2
        assert sorted(x for r in fakes for x in r.resumes) == [[], [7]]  # sent again with what it had delivered
    for r in fakes:
        r.calls = 0
    with Client([r.address for r in fakes], timeout=10) as client:  # resuming off: the break reaches the caller
        _ready(client, fakes)
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream("p", max_tokens=5, resume_attempts=0))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "mid-stream" in err.value.details()
        assert sum(r.calls for r in fakes) == 1


def test_attempts_are_bounded_and_other_codes_are_not_retried(fakes: list[FakeReplica]) -> None:
    for r in fakes:
        r.refuse = grpc.StatusCode.UNAVAILABLE
    with Client([r.address for r in fakes], timeout=10, retry=RetryPolicy(max_attempts=4)) as client:
        _ready_then(client, fakes)
        with pytest.raises(grpc.RpcError) as err:
            client.generate("p")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert sum(r.calls for r in fakes) == 4
        for r in fakes:
            r.refuse, r.calls = grpc.StatusCode.INVALID_ARGUMENT, 0
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream("p"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and sum(r.calls for r in fakes) == 1
    for r in fakes:
        r.refuse, r.calls = grpc.StatusCode.UNAVAILABLE, 0
    with Client([r.address for r in fakes], timeout=10, retry=None) as client:  # retries off
        _ready_then(client, fakes)
        with pytest.raises(grpc.RpcError):
            client.generate("p")
        assert sum(r.calls for r in fakes) == 1


def test_async_client_and_cli_take_several_addresses(
    fakes: list[FakeReplica], capsys: pytest.CaptureFixture[str]
) -> None:
    fakes[0].refuse = grpc.StatusCode.UNAVAILABLE
    addresses = [r.address for r in fakes]

    async def main() -> list[object]:
        async with AsyncClient(addresses, timeout=10) as c:
            return [i async for i in c.stream("p")] + [await c.generate("p") for _ in range(6)]

    got = asyncio.run(main())
    assert isinstance(got[0], StreamToken) and len(got) == 8
    out = io.StringIO()
    assert generate_main(["p", "--address", ",".join(addresses), "--json"], out=out) == 0
    assert [json.loads(line)["type"] for line in out.getvalue().splitlines()] == ["token", "finish"]
    for argv, says in (
        (["p", "--address", "a.example:1,b.example:2"], "--address: several addresses"),
        (["p", "--address", addresses[1], "--max-attempts", "9"], "--max-attempts: 1 to 5"),
    ):
        with pytest.raises(SystemExit):
            generate_main(argv, out=io.StringIO())
        assert says in capsys.readouterr().err


# --- two real replicas ----------------------------------------------------------------------------------------

N_REPLICAS = 2
REPLICA = EngineConfig(model="ouro-tiny", max_num_seqs=2, num_kv_blocks=256, max_waiting=32)


@dataclass
class Replica:
    handle: ServeHandle
    metrics_url: str

    @property
    def address(self) -> str:
        return self.handle.address

    def finished(self) -> int:
        """Requests this replica finished (``cdb_requests_finished_total``, every reason)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            lines = reply.read().decode().splitlines()
        return round(sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("cdb_requests_finished_total{")))


def _start_replica() -> Replica:
    metrics = f"127.0.0.1:{free_port()}"
    # A fixed port, as a replica behind a Service has: the supervisor would restart a scheduler on it.
    handle = serve_all(REPLICA, f"127.0.0.1:{free_port()}", env={**os.environ, **TEST_ENV}, metrics_listen=metrics)
    return Replica(handle, f"http://{metrics}/metrics")


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[Replica]]:
    with futures.ThreadPoolExecutor(N_REPLICAS) as pool:
        started = [pool.submit(_start_replica) for _ in range(N_REPLICAS)]
        try:
            yield [f.result() for f in started]
        finally:
            done = [f.result() for f in started if f.exception() is None]
            list(pool.map(lambda r: r.handle.stop(drain_timeout=2.0), done))


def test_one_client_spreads_requests_over_the_replicas(replicas: list[Replica]) -> None:
    n = 30
    with Client([r.address for r in replicas], timeout=60) as client:
        grpc.channel_ready_future(client.channel).result(timeout=10)
        for _ in range(6):  # warm-up: every backend connected and in the rotation
            client.generate("warm", max_tokens=1)
        before = [r.finished() for r in replicas]
        with futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: client.generate(f"p{i}", max_tokens=4, ignore_eos=True), range(n)))
        assert all(r.finish.generated_tokens == 4 for r in results)
    served = [r.finished() - b for r, b in zip(replicas, before)]
    assert sum(served) == n
    assert all(0.8 * n / N_REPLICAS <= s <= 1.2 * n / N_REPLICAS for s in served), served


def test_a_dead_replica_loses_no_stream_its_streams_resume_on_the_others(replicas: list[Replica]) -> None:
    long = GenerateOptions(max_tokens=300, ignore_eos=True)
    per_replica = 2 * REPLICA.max_num_seqs  # two running, two waiting on each replica
    with Client([r.address for r in replicas], timeout=60) as client:
        grpc.channel_ready_future(client.channel).result(timeout=10)
        for _ in range(6):
            client.generate("warm", max_tokens=1)
        runs = [
            StreamRun(client, f"p{i}", GenerateOptions(long, request_id=f"r{i}")).start()
            for i in range(N_REPLICAS * per_replica)
        ]
        for r in replicas:
            with Client(r.address, timeout=10) as direct:
                wait_for_counters(
                    direct,
                    lambda c: c["running"] == c["waiting"] == per_replica // 2,  # admission may lag the arrivals
                    "two running and two waiting requests per replica",
                    30,
                )
        deadline = time.monotonic() + 30
        while sum(1 for run in runs if run.tokens) < N_REPLICAS * per_replica // 2 and time.monotonic() < deadline:
            threading.Event().wait(0.02)  # every running request has streamed a token
        victim = replicas[0].handle
        assert victim.scheduler is not None
        victim.unsupervise()  # the replica stays dead
        with Client(victim.address, timeout=10) as direct:
            held = direct.info().counters
        victim.scheduler.send_signal(signal.SIGKILL)
        assert victim.scheduler.wait(timeout=10) == -signal.SIGKILL
        with futures.ThreadPoolExecutor(4) as pool:  # requests sent after the death complete on the others
            after = list(pool.map(lambda i: client.generate(f"after {i}", max_tokens=3, ignore_eos=True), range(4)))
        assert all(r.finish.generated_tokens == 3 for r in after)
        for run in runs:  # every call ends: each has a deadline
            assert run.done.wait(70), "a call did not end"
    assert held["running"] == 2 and held["waiting"] == 2
    for run in runs:  # the victim's streams too: resumed on the others, whole, under their own ids, nothing twice
        assert run.error is None, (run.code, len(run.tokens))
        assert run.finish is not None and run.finish.finish_reason == "length"
        assert run.finish.generated_tokens == len(run.tokens) == long["max_tokens"]  # (resumed ones added back)
        assert {t.request_id for t in run.tokens} == {run.finish.request_id}
