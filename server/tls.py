"""TLS certificates: make a self-signed one on first start, read a configured one, compute fingerprints.

Clients pin the server by the SHA-256 fingerprint of its certificate (DER), printed at every start as
``sha256:<64 hex>``; `isrctl.remote` accepts the same string.
"""
from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import socket
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .errors import TLSError

SELF_SIGNED_DAYS = 3650


def fingerprint_der(der: bytes) -> str:
    """The pinning fingerprint of a DER certificate: ``sha256:`` and 64 lowercase hex digits."""
    return "sha256:" + hashlib.sha256(der).hexdigest()


def fingerprint_file(cert_path: Path) -> str:
    """The fingerprint of the first (leaf) certificate in a PEM file."""
    try:
        pem = cert_path.read_bytes()
        cert = x509.load_pem_x509_certificate(pem)
    except OSError as e:
        raise TLSError(f"cannot read certificate {cert_path}: {e.strerror}") from None
    except ValueError as e:
        raise TLSError(f"certificate {cert_path} is not a PEM certificate: {e}") from None
    return fingerprint_der(cert.public_bytes(serialization.Encoding.DER))


def certificate_path(data_dir: Path, cert: str) -> Path:
    """Where isr-server takes its certificate from: `cert` (``server.tls_cert``) if set, else the
    self-signed one in data_dir/tls (which `ensure_certificate` makes at the first start)."""
    return Path(cert) if cert else data_dir / "tls" / "server.crt"


def certificate_hosts(cert_path: Path) -> list[str]:
    """The DNS names of a PEM certificate's subjectAltName, in the certificate's order (none: empty)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return []
    return list(alt.get_values_for_type(x509.DNSName))


def make_self_signed(cert_path: Path, key_path: Path, names: list[str] | None = None) -> str:
    """Write a new self-signed EC P-256 certificate and PKCS#8 key; return its fingerprint.

    The certificate names localhost, 127.0.0.1, ::1 and this host's name, plus `names`. The key file is
    created mode 0600 and both files are written with temp + fsync + rename.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    hostname = socket.gethostname()
    dns = {"localhost", hostname, *(n for n in (names or []) if not _is_ip(n))}
    ips = {"127.0.0.1", "::1", *(n for n in (names or []) if _is_ip(n))}
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"isr-server {hostname}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(n) for n in sorted(dns)] + [x509.IPAddress(ipaddress.ip_address(i)) for i in sorted(ips)]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    try:
        cert_path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(key_path, key_pem, 0o600)
        _write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    except OSError as e:
        raise TLSError(f"cannot write the self-signed certificate in {cert_path.parent}: {e.strerror}") from None
    return fingerprint_der(cert.public_bytes(serialization.Encoding.DER))


def ensure_certificate(data_dir: Path, cert: str, key: str) -> tuple[Path, Path, str, bool]:
    """Return (cert path, key path, fingerprint, created).

    With `cert` and `key` set, check they exist. Otherwise use data_dir/tls/server.{crt,key}, creating a
    self-signed pair the first time.
    """
    cert_path = certificate_path(data_dir, cert)
    if cert:
        key_path = Path(key)
        if not key_path.is_file():
            raise TLSError(f"server.tls_key: {key_path} does not exist")
        return cert_path, key_path, fingerprint_file(cert_path), False
    key_path = cert_path.with_name("server.key")
    if cert_path.is_file() and key_path.is_file():
        return cert_path, key_path, fingerprint_file(cert_path), False
    return cert_path, key_path, make_self_signed(cert_path, key_path), True


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
