"""Test certificates made with ``cryptography``: a CA, a server certificate for 127.0.0.1 and localhost, client
certificates for mTLS. Keys are P-256 (fast to make); everything is PEM bytes."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pem:
    """A certificate and its private key, PEM."""

    cert: bytes
    key: bytes

    def write(self, folder: Path, name: str) -> tuple[Path, Path]:
        """``NAME.crt`` and ``NAME.key`` (mode 0600) in ``folder``."""
        cert, key = folder / f"{name}.crt", folder / f"{name}.key"
        cert.write_bytes(self.cert)
        key.write_bytes(self.key)
        key.chmod(0o600)
        return cert, key


class CertificateAuthority:
    """A self-signed CA that issues server and client certificates valid for a day."""

    def __init__(self, name: str = "cdb test CA") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = self._builder(self._name, self._key.public_key()).add_extension(
            x509.BasicConstraints(ca=True, path_length=0), critical=True
        )
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        self.cert = builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    def _builder(self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def _issue(self, common_name: str, usage: x509.ObjectIdentifier, names: list[x509.GeneralName]) -> Pem:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cdb tests"),
                x509.NameAttribute(NameOID.COMMON_NAME, common_name),
            ]
        )
        builder = self._builder(subject, key.public_key())
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return Pem(cert, key_pem)

    def server(self) -> Pem:
        """A server certificate for ``127.0.0.1`` and ``localhost``."""
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        return self._issue("localhost", ExtendedKeyUsageOID.SERVER_AUTH, names)

    def client(self, common_name: str) -> Pem:
        """A client certificate (mTLS) with subject ``O=cdb tests, CN=common_name``."""
        return self._issue(common_name, ExtendedKeyUsageOID.CLIENT_AUTH, [])
