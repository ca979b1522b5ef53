"""TLS and mTLS on the public port with real certificates made here: a CA, a server certificate for 127.0.0.1 and
localhost, client certificates; plaintext, a wrong CA and missing / foreign client certificates are refused;
client certificates scope request ids; the flags of ``cdb scheduler`` / ``cdb serve`` and the clients' options."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from cdb_engine.engine import Engine
from clients.async_client import AsyncClient
from clients.channel import TlsOptions
from clients.cli import generate_main
from clients.messages import StreamFinish
from clients.sync_client import Client
from services.api.security import PortSecurity, SecurityConfigError
from services.net import wait_ready_file
from services.settings import Settings
from tests.services.certs import CertificateAuthority, Pem
from tests.services.public_port import PublicServer, public_server, tiny_engine

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Pki:
    folder: Path
    ca: bytes  # the CA of the server and of the accepted clients
    server: Pem
    alice: Pem  # O=cdb tests, CN=alice
    bob: Pem
    wrong_ca: bytes  # another CA, which signed nothing of the server's
    mallory: Pem  # a client certificate from the wrong CA

    def path(self, name: str) -> str:
        return str(self.folder / name)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca, wrong = CertificateAuthority("cdb test CA"), CertificateAuthority("some other CA")
    pki = Pki(folder, ca.cert, ca.server(), ca.client("alice"), ca.client("bob"), wrong.cert, wrong.client("mallory"))
    (folder / "ca.crt").write_bytes(pki.ca)
    (folder / "wrong-ca.crt").write_bytes(pki.wrong_ca)
    pki.server.write(folder, "server")
    pki.alice.write(folder, "alice")
    return pki


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with tiny_engine() as engine:
        yield engine


def _settings(pki: Pki, mtls: bool, **kw: object) -> Settings:
    client_ca = pki.path("ca.crt") if mtls else ""
    tls = {"tls_cert": pki.path("server.crt"), "tls_key": pki.path("server.key"), "tls_client_ca": client_ca}
    return Settings(health_interval_s=0.05, **tls, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tls_server(engine: Engine, pki: Pki) -> Iterator[PublicServer]:
    with public_server(engine, _settings(pki, mtls=False)) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(engine: Engine, pki: Pki) -> Iterator[PublicServer]:
    with public_server(engine, _settings(pki, mtls=True)) as server:
        yield server


def _generate(address: str, tls: TlsOptions | None, **kw: object) -> str:
    with Client(address, timeout=10, tls=tls, **kw) as client:  # type: ignore[arg-type]
        return client.generate("hello", max_tokens=3, ignore_eos=True).finish.finish_reason


def _refused(address: str, tls: TlsOptions | None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        _generate(address, tls)
    return err.value.code()


def test_tls_serves_clients_that_trust_its_ca_by_ip_and_by_name(tls_server: PublicServer, pki: Pki) -> None:
    assert tls_server.security.describe() == "TLS, no API keys"
    assert _generate(tls_server.address, TlsOptions(root_certificates=pki.ca)) == "length"
    assert _generate(f"localhost:{tls_server.port}", TlsOptions(root_certificates=pki.ca)) == "length"
    with Client(tls_server.address, tls=TlsOptions(root_certificates=pki.ca)) as client:
        assert client.health() == "SERVING"


def test_tls_refuses_plaintext_and_clients_trusting_another_ca(tls_server: PublicServer, pki: Pki) -> None:
    assert _refused(tls_server.address, None) == grpc.StatusCode.UNAVAILABLE
    assert _refused(tls_server.address, TlsOptions(root_certificates=pki.wrong_ca)) == grpc.StatusCode.UNAVAILABLE


def test_mtls_requires_a_client_certificate_from_its_ca(mtls_server: PublicServer, pki: Pki) -> None:
    assert mtls_server.security.describe() == "TLS, client certificates required, no API keys"
    alice = TlsOptions(pki.ca, pki.alice.cert, pki.alice.key)
    assert _generate(mtls_server.address, alice) == "length"
    assert _refused(mtls_server.address, TlsOptions(root_certificates=pki.ca)) == grpc.StatusCode.UNAVAILABLE
    mallory = TlsOptions(pki.ca, pki.mallory.cert, pki.mallory.key)
    assert _refused(mtls_server.address, mallory) == grpc.StatusCode.UNAVAILABLE
    assert _refused(mtls_server.address, None) == grpc.StatusCode.UNAVAILABLE


def test_client_certificates_scope_request_ids(mtls_server: PublicServer, pki: Pki) -> None:
    alice = TlsOptions(pki.ca, pki.alice.cert, pki.alice.key)
    bob = TlsOptions(pki.ca, pki.bob.cert, pki.bob.key)
    with Client(mtls_server.address, timeout=30, tls=alice) as a, Client(mtls_server.address, tls=bob) as b:
        stream = a.stream("hello", request_id="job", max_tokens=1000, ignore_eos=True)
        next(stream)
        (scoped,) = mtls_server.door.live
        assert scoped.startswith("cert-") and scoped.endswith("/job")
        assert b.generate("x", request_id="job", max_tokens=2).request_id == "job"  # bob's own "job"
        assert b.abort("job") is False
        assert a.abort("job") is True
        *_, finish = stream
        assert isinstance(finish, StreamFinish) and finish.finish_reason == "cancelled"


def test_async_client_over_mtls_with_an_api_key(engine: Engine, pki: Pki) -> None:
    settings = _settings(pki, mtls=True, api_keys="async-key")

    async def main(address: str) -> None:
        tls = TlsOptions.from_files(pki.path("ca.crt"), pki.path("alice.crt"), pki.path("alice.key"))
        async with AsyncClient(address, timeout=30, tls=tls, api_key="async-key") as client:
            assert (await client.generate([5, 6, 7], max_tokens=3)).finish.finish_reason in ("length", "stop")
            assert await client.abort("nothing") is False
        async with AsyncClient(address, timeout=30, tls=tls) as keyless:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await keyless.info()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert await keyless.health() == "SERVING"

    with public_server(engine, settings) as server:
        asyncio.run(main(server.address))


def test_cdb_generate_with_tls_options_and_an_api_key(
    engine: Engine, pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("# my key\ncli-key\n")
    mtls = ["--tls-ca", pki.path("ca.crt"), "--tls-cert", pki.path("alice.crt"), "--tls-key", pki.path("alice.key")]
    with public_server(engine, _settings(pki, mtls=True, api_keys="cli-key,env-key")) as server:
        base = ["hi", "--address", server.address, "--max-tokens", "3", "--ignore-eos", "--timeout", "30"]
        out = io.StringIO()
        assert generate_main([*base, *mtls, "--api-key-file", str(key_file)], out=out) == 0
        monkeypatch.setenv("CDB_API_KEY", "env-key")
        assert generate_main([*base, *mtls, "--show-depth"], out=io.StringIO()) == 0
        monkeypatch.setenv("CDB_API_KEY", "not-a-key")
        assert generate_main([*base, *mtls], out=io.StringIO()) == 1
        assert "error: UNAUTHENTICATED: invalid API key" in capsys.readouterr().err
        monkeypatch.delenv("CDB_API_KEY")
        assert generate_main([*base, "--tls-ca", pki.path("ca.crt")], out=io.StringIO()) == 1  # no client cert
        assert "error: UNAVAILABLE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate_main([*base, "--tls-ca", str(tmp_path / "absent.crt")])
    assert "cannot read the CA file" in capsys.readouterr().err


def test_unusable_tls_files_name_the_variable(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(SecurityConfigError, match=r"^CDB_TLS_CERT: cannot read .*absent\.crt"):
        PortSecurity.from_settings(Settings(tls_cert=str(tmp_path / "absent.crt"), tls_key=pki.path("server.key")))
    with pytest.raises(SecurityConfigError, match=r"^CDB_TLS_CERT / CDB_TLS_KEY: .* not a matching"):
        PortSecurity.from_settings(Settings(tls_cert=pki.path("server.crt"), tls_key=pki.path("alice.key")))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(SecurityConfigError, match=r"^CDB_TLS_CLIENT_CA: .*garbage\.pem is not a PEM CA bundle"):
        PortSecurity.from_settings(
            Settings(tls_cert=pki.path("server.crt"), tls_key=pki.path("server.key"), tls_client_ca=str(garbage))
        )


def test_cdb_serve_hands_the_flags_to_the_tree(pki: Pki, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from cdb import serve

    keys = tmp_path / "keys"
    keys.write_text("serve-key\n")
    keys.chmod(0o600)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("CDB_")})
    seen: list[Settings] = []

    def fake_serve_forever(resolved: Any, listen: str) -> int:
        seen.append(resolved.settings)  # what the launcher hands its children
        return 0

    monkeypatch.setattr(serve, "serve_forever", fake_serve_forever)
    monkeypatch.chdir(pki.folder)
    flags = ["--tls-cert", "server.crt", "--tls-key", "server.key", "--tls-client-ca", "ca.crt"]
    assert serve.serve_main([*flags, "--api-keys-file", str(keys), "--listen", "127.0.0.1:0", "--no-http"]) == 0
    settings = seen.pop()
    assert settings.tls_cert == pki.path("server.crt")  # absolute: a child may run elsewhere
    assert settings.tls_key == pki.path("server.key")
    assert settings.tls_client_ca == pki.path("ca.crt")
    assert settings.api_keys_file == str(keys)
    with pytest.raises(SystemExit):  # a key without its certificate is refused before anything starts
        serve.serve_main(["--tls-key", "server.key", "--listen", "127.0.0.1:0"])
    assert not seen


@pytest.mark.slow
def test_cdb_scheduler_flags_serve_mtls_with_api_keys(pki: Pki, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# deployment keys\nprocess-key\n")
    keys.chmod(0o600)
    ready = tmp_path / "ready"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CDB_")} | {"OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "cdb", "scheduler", "--in-process", "--model", "ouro-tiny", "--listen", "127.0.0.1:0"]
    argv += ["--tls-cert", pki.path("server.crt"), "--tls-key", pki.path("server.key")]
    argv += ["--tls-client-ca", pki.path("ca.crt"), "--api-keys-file", str(keys), "--ready-file", str(ready)]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        address = wait_ready_file(str(ready), proc, 60, "scheduler")
        alice = TlsOptions(pki.ca, pki.alice.cert, pki.alice.key)
        assert _generate(address, alice, api_key="process-key") == "length"
        with Client(address, timeout=10, tls=alice) as client:
            assert client.health() == "SERVING"
            with pytest.raises(grpc.RpcError) as err:
                client.info()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _refused(address, TlsOptions(root_certificates=pki.ca)) == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0].decode(errors="replace")
    assert proc.returncode == 0, output
    assert "(TLS, client certificates required, 1 API key)" in output
    assert "process-key" not in output


def test_the_health_probe_speaks_tls_and_mtls(tls_server: PublicServer, mtls_server: PublicServer, pki: Pki) -> None:
    from services.healthcheck import main as probe

    assert probe([tls_server.address, "-q", "--tls-ca", pki.path("ca.crt")]) == 0
    assert probe([tls_server.address, "-q"]) == 1  # plaintext against TLS
    assert probe([tls_server.address, "-q", "--tls-ca", pki.path("wrong-ca.crt")]) == 1
    mtls = ["--tls-ca", pki.path("ca.crt"), "--tls-cert", pki.path("alice.crt"), "--tls-key", pki.path("alice.key")]
    assert probe([mtls_server.address, "-q", *mtls]) == 0
    assert probe([mtls_server.address, "-q", "--tls-ca", pki.path("ca.crt")]) == 1  # no client certificate
