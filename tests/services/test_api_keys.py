"""API keys on the public port: missing / malformed / wrong keys are UNAUTHENTICATED before any work, right keys
(from ``CDB_API_KEYS`` and ``CDB_API_KEYS_FILE``) are served, health stays open, reflection does not."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cdb_engine.engine import Engine
from clients.sync_client import Client
from services.api.errors import Unauthenticated
from services.api.security import ANONYMOUS_SCOPE, CallerAuth, SecurityConfigError, read_api_keys
from services.settings import Settings
from tests.services.public_port import PublicServer, assert_no_errors_logged, public_server, tiny_engine

pytestmark = pytest.mark.timeout(60)

KEYS_FILE = "# keys of the test deployment\n\n  gamma-key-3  \n# a retired key: delta-key\n"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with tiny_engine() as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PublicServer]:
    keys_file = tmp_path_factory.mktemp("keys") / "api-keys"
    keys_file.write_text(KEYS_FILE)
    keys_file.chmod(0o600)
    settings = Settings(api_keys="alpha-key-1, beta-key-2", api_keys_file=str(keys_file), health_interval_s=0.05)
    with public_server(engine, settings) as server:
        yield server


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ((), "missing API key: send metadata 'authorization: Bearer KEY'"),
        ((("authorization", "Basic YWxwaGEta2V5LTE="),), "malformed authorization metadata: expected 'Bearer KEY'"),
        ((("authorization", "Bearer"),), "malformed authorization metadata: expected 'Bearer KEY'"),
        ((("authorization", "Bearer alpha-key-2"),), "invalid API key"),
        ((("authorization", "Bearer delta-key"),), "invalid API key"),  # commented out in the file
    ],
)
def test_calls_without_a_valid_key_are_unauthenticated_and_do_no_work(
    server: PublicServer, engine: Engine, metadata: tuple[tuple[str, str], ...], message: str
) -> None:
    before = engine.stats()
    with Client(server.address, timeout=10, metadata=metadata) as client:
        calls = [
            lambda: client.generate("hello", max_tokens=4),
            lambda: list(client.stream("hello", max_tokens=4)),
            lambda: client.abort("some-id"),
            lambda: client.info(),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert err.value.details() == message
    after = engine.stats()
    assert (after.tokens, after.loop_steps) == (before.tokens, before.loop_steps)
    assert not server.door.live


@pytest.mark.parametrize("key", ["alpha-key-1", "beta-key-2", "gamma-key-3"])
def test_each_configured_key_is_served(server: PublicServer, key: str) -> None:
    with Client(server.address, timeout=30, api_key=key) as client:
        result = client.generate("hello", max_tokens=4, ignore_eos=True, request_id="r-1")
        assert result.request_id == "r-1" and len(result.tokens) == 4
        assert client.info().architecture == "ouro"
    with Client(server.address, timeout=30, metadata=[("authorization", f"bearer {key}")]) as client:
        assert client.info().healthy  # the scheme is case-insensitive


def test_health_is_open_without_a_key(server: PublicServer) -> None:
    with Client(server.address, timeout=10) as client:
        assert client.health() == "SERVING"
        assert client.health("cdb.v1.Generation") == "SERVING"
        client.wait_for_status("SERVING", timeout=10)  # the Watch stream, too


def _list_services(address: str, metadata: tuple[tuple[str, str], ...]) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10)
        return [s.name for reply in replies for s in reply.list_services_response.service]


def test_reflection_needs_a_key(server: PublicServer) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _list_services(server.address, ())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    names = _list_services(server.address, (("authorization", "Bearer beta-key-2"),))
    assert "cdb.v1.Generation" in names and "grpc.health.v1.Health" in names


def test_an_unknown_method_without_a_key_is_unauthenticated_not_unimplemented(server: PublicServer) -> None:
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary("/cdb.v1.Generation/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as err:
            call(b"", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            call(b"", timeout=10, metadata=(("authorization", "Bearer alpha-key-1"),))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_an_undecodable_request_without_a_key_is_unauthenticated(
    server: PublicServer, caplog: pytest.LogCaptureFixture
) -> None:
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/cdb.v1.Generation/Generate")(b"\x0a\x02\xff\xfe", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert_no_errors_logged(caplog)


def test_every_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    auth = CallerAuth(["k-one", "k-two", "k-three"])
    assert auth.refusal([("authorization", "Bearer k-one")]) is None
    assert len(compared) == 3  # no early exit on the match
    assert all(len(a) == len(b) == 32 for a, b in compared)  # digests: the key's length does not show either
    compared.clear()
    assert auth.refusal([("authorization", "Bearer nope")]) == "invalid API key"
    assert len(compared) == 3


def test_key_sources_parse_and_merge(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(KEYS_FILE + "epsilon-key-5\n")
    path.chmod(0o600)
    keys = read_api_keys(Settings(api_keys=" alpha-key-1 ,,beta-key-2,", api_keys_file=str(path)))
    assert keys == ["alpha-key-1", "beta-key-2", "gamma-key-3", "epsilon-key-5"]
    assert read_api_keys(Settings()) == []


def test_bad_key_sources_name_the_variable_and_never_the_key(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    with pytest.raises(SecurityConfigError, match=rf"^CDB_API_KEYS_FILE: cannot read {missing}: No such file"):
        read_api_keys(Settings(api_keys_file=str(missing)))
    only_comments = tmp_path / "empty"
    only_comments.write_text("# nothing here\n\n")
    with pytest.raises(SecurityConfigError, match=r"^CDB_API_KEYS_FILE: .*empty holds no key$"):
        read_api_keys(Settings(api_keys_file=str(only_comments)))
    spaced = tmp_path / "spaced"
    spaced.write_text("good-key\nsecret with spaces\n")
    with pytest.raises(SecurityConfigError, match=r"^CDB_API_KEYS_FILE: line 2 is not a printable ASCII key") as err:
        read_api_keys(Settings(api_keys_file=str(spaced)))
    assert "secret" not in str(err.value)
    with pytest.raises(SecurityConfigError, match=r"^CDB_API_KEYS: key 2 is not") as err:
        read_api_keys(Settings(api_keys="fine,caf\u00e9-key"))
    assert "caf" not in str(err.value)


def test_scopes_are_stable_digests_per_key_then_per_certificate_then_anonymous() -> None:
    keyed = CallerAuth(["first-key", "second-key"])
    first = keyed.scope_of([("authorization", "Bearer first-key")])
    assert first == keyed.scope_of([("x-other", "1"), ("authorization", "bearer first-key")], b"CN=someone")
    assert first != keyed.scope_of([("authorization", "Bearer second-key")])
    assert first.startswith("key-") and len(first) == 16 and "first" not in first
    with pytest.raises(Unauthenticated, match=r"^invalid API key$"):
        keyed.scope_of([("authorization", "Bearer third-key")])
    open_port = CallerAuth()
    alice = open_port.scope_of([], b"O=cdb tests,CN=alice")
    assert alice.startswith("cert-") and alice != open_port.scope_of([], b"O=cdb tests,CN=bob")
    assert open_port.scope_of([("authorization", "Bearer anything")]) == ANONYMOUS_SCOPE
