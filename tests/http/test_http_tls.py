"""The HTTP API on the public port's TLS settings (``CDB_TLS_CERT`` / ``CDB_TLS_KEY``, ``CDB_TLS_CLIENT_CA``)."""

from __future__ import annotations

import ssl
from dataclasses import replace
from pathlib import Path

import httpx2
import openai
import pytest

from tests.http.harness import SETTINGS, Served, served
from tests.services.certs import CertificateAuthority

pytestmark = pytest.mark.timeout(120)


def _client(s: Served, ca: Path, cert: tuple[Path, Path] | None = None) -> openai.OpenAI:
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    return s.client(http_client=httpx2.Client(verify=context, timeout=60))


def _complete(client: openai.OpenAI) -> str | None:
    """One completion's finish reason; the client is closed after it (an idle TLS connection would hold the
    server's graceful stop until the peer answers the close)."""
    with client:
        out = client.completions.create(model="ouro-tiny", prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
        return out.choices[0].finish_reason


def test_tls_and_client_certificates(tmp_path: Path) -> None:
    ca, other = CertificateAuthority(), CertificateAuthority("another CA")
    (tmp_path / "ca.crt").write_bytes(ca.cert)
    server_cert, server_key = ca.server().write(tmp_path, "server")
    alice = ca.client("alice").write(tmp_path, "alice")
    mallory = other.client("mallory").write(tmp_path, "mallory")
    tls = replace(SETTINGS, tls_cert=str(server_cert), tls_key=str(server_key))
    with served(settings=tls) as s:
        assert s.base_url.startswith("https://")
        assert _complete(_client(s, tmp_path / "ca.crt")) == "length"
        with pytest.raises(openai.APIConnectionError):  # plaintext to a TLS port
            _complete(s.client(base_url=s.base_url.replace("https://", "http://")))
    with served(settings=replace(tls, tls_client_ca=str(tmp_path / "ca.crt"))) as s:
        assert _complete(_client(s, tmp_path / "ca.crt", alice)) == "length"
        for cert in (None, mallory):
            with pytest.raises(openai.APIConnectionError):
                _complete(_client(s, tmp_path / "ca.crt", cert))
