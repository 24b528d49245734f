"""Signed requests: ``llmq-signature: v1=<hex>``, HMAC-SHA256 of the message value with the tenant's secret.

The value is the request exactly as written to Kafka (the encoded record), so the gateway checks
the bytes it read, not a re-encoding. The header may carry several comma-separated ``v1=``
entries (during a secret rotation a producer signs with both). A record holds only a reference
to its secret, resolved where signatures are made or checked:

* ``env:NAME``  — the environment variable NAME;
* ``file:NAME`` — the file NAME inside ``[tenants] secrets_dir`` (no directories, no ``..``: a
  registry writer cannot point a gateway at an arbitrary file).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from pipeline.errors import LlmqError

SIGNATURE_HEADER = "llmq-signature"
_SCHEME = "v1="


class SecretError(LlmqError):
    """A signing secret reference that cannot be resolved (the message never quotes a secret)."""


def sign(secret: bytes, raw: bytes) -> str:
    return _SCHEME + hmac.new(secret, raw, hashlib.sha256).hexdigest()


def signature_header(secret: bytes, raw: bytes) -> tuple[str, bytes]:
    return SIGNATURE_HEADER, sign(secret, raw).encode()


def verify(secret: bytes, raw: bytes, header: str) -> bool:
    """Whether one of the header's ``v1=`` entries is the HMAC of ``raw`` (constant-time compare)."""
    want = hmac.new(secret, raw, hashlib.sha256).hexdigest()
    ok = False
    for entry in header.split(","):
        entry = entry.strip()
        if entry.startswith(_SCHEME):
            # Every entry compared, so timing does not tell which one matched.
            ok |= hmac.compare_digest(entry[len(_SCHEME):].lower(), want)
    return ok


def find_header(headers: Any) -> str | None:
    """The signature header's value among Kafka headers (list of pairs or a mapping) or HTTP headers."""
    if not headers:
        return None
    items: Iterable = headers.items() if isinstance(headers, Mapping) else headers
    for name, value in items:
        if isinstance(name, bytes):
            name = name.decode("latin-1")
        if name.lower() == SIGNATURE_HEADER:
            if isinstance(value, bytes):
                try:
                    return value.decode("ascii")
                except UnicodeDecodeError:
                    return ""
            return "" if value is None else str(value)
    return None


def resolve_secret(ref: str, secrets_dir: str, env: Mapping[str, str] | None = None) -> bytes:
    env = os.environ if env is None else env
    kind, _, name = ref.partition(":")
    if not name:
        raise SecretError("signing secret reference must be env:NAME or file:NAME")
    if kind == "env":
        value = env.get(name)
        if not value:
            raise SecretError(f"signing secret variable {name} is not set")
        return value.encode()
    if kind == "file":
        if not secrets_dir:
            raise SecretError("file: signing secrets need [tenants] secrets_dir")
        if "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
            raise SecretError("a file: signing secret names a file inside secrets_dir, without directories")
        try:
            value = (Path(secrets_dir) / name).read_bytes().strip()
        except OSError as exc:
            raise SecretError(f"signing secret file {name!r}: {exc.strerror}") from None
        if not value:
            raise SecretError(f"signing secret file {name!r} is empty")
        return value
    raise SecretError("signing secret reference must be env:NAME or file:NAME")
