"""Security material for the local secured broker: a private CA, a broker certificate, and
SCRAM credentials for one principal per role.

Production clusters bring their own CA and users; this module exists so that the same
SASL_SSL + SCRAM + ACL set-up can be run and tested on one machine. Secrets are written
to files with mode 0600 under ``<data-dir>/secrets`` and never printed or logged: commands
print the *paths* of the password files.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

#: The principals the local secured broker knows, one per role (see pipeline.acls).
ROLES = ("admin", "producer", "gateway", "worker", "consumer", "client", "lagexporter")
SCRAM_MECHANISM = "SCRAM-SHA-512"


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path  # PEM, what clients trust (ssl.ca.location)
    broker_keystore: Path  # PEM: PKCS#8 key + certificate chain, for the broker
    broker_cert: Path


def ensure_tls(directory: Path, hostnames: tuple[str, ...] = ("localhost",),
               ips: tuple[str, ...] = ("127.0.0.1",)) -> TlsFiles:
    """Create a private CA and a broker certificate once (reused afterwards)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "ca.pem", directory / "broker-keystore.pem", directory / "broker.pem")
    if files.ca_cert.exists() and files.broker_keystore.exists():
        return files
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmq local CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=3650))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(h) for h in hostnames] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmq-broker")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=825))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                  x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    ca_pem = ca_cert.public_bytes(pem)
    cert_pem = cert.public_bytes(pem)
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write_private(files.broker_keystore, key_pem + cert_pem + ca_pem)
    files.broker_cert.write_bytes(cert_pem)
    files.ca_cert.write_bytes(ca_pem)
    return files


def ensure_passwords(directory: Path, roles: tuple[str, ...] = ROLES) -> dict[str, Path]:
    """One random password per role, in ``<directory>/<role>.password`` (0600); reused once made."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    paths = {}
    for role in roles:
        path = directory / f"{role}.password"
        if not path.exists():
            _write_private(path, secrets.token_urlsafe(24).encode())
        paths[role] = path
    return paths


def read_secret(path: str | os.PathLike) -> str:
    return Path(path).read_text().strip()


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def redact(config: dict) -> dict:
    """A copy of a client property dict fit for logs and error messages."""
    return {k: ("[redacted]" if any(s in k.lower() for s in ("password", "secret", "jaas", ".key"))
                else v) for k, v in config.items()}
