"""isr-server's certificates: the self-signed one made on first start is kept, and a configured certificate
issued by a throwaway test CA is served and verified by the client through the CA file."""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from isrctl.remote import Remote, RemoteUnreachable
from server.tls import fingerprint_file
from tests.server_fixtures import ServerProcess, write_config

pytestmark = pytest.mark.timeout(120)


def make_ca_and_server_cert(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it; returns (ca, cert, key)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "isr test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_path, cert_path, key_path = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca_path, cert_path, key_path


def test_self_signed_certificate_is_made_once(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", {"server.listen": "127.0.0.1:0", "server.data_dir": str(tmp_path / "d")})
    first = ServerProcess(config, tmp_path / "1.log").start()
    first.stop()
    second = ServerProcess(config, tmp_path / "2.log").start()
    try:
        assert first.fingerprint == second.fingerprint == fingerprint_file(tmp_path / "d" / "tls" / "server.crt")
        with second.client() as client:
            assert client.health()["status"] == "ok"
    finally:
        second.stop()


def test_configured_certificate_from_a_ca(tmp_path: Path) -> None:
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    config = write_config(tmp_path / "c.toml", {"server.listen": "127.0.0.1:0", "server.data_dir": str(tmp_path / "d"),
                                                "server.tls_cert": str(cert), "server.tls_key": str(key)})
    server = ServerProcess(config, tmp_path / "s.log").start()
    try:
        assert server.fingerprint == fingerprint_file(cert)
        assert not (tmp_path / "d" / "tls").exists()
        with Remote(server.url, ca_file=ca) as client:
            assert client.health()["status"] == "ok"
        with Remote(server.url.replace("127.0.0.1", "localhost"), ca_file=ca) as client:
            assert client.health()["status"] == "ok"
        (tmp_path / "other").mkdir()
        other_ca, _, _ = make_ca_and_server_cert(tmp_path / "other")
        with Remote(server.url, ca_file=other_ca) as client:
            with pytest.raises(RemoteUnreachable):
                client.health()
    finally:
        server.stop()
