"""API keys: only their SHA-256 hashes are stored, never the keys.

A key is a random secret (``llmq-`` + 32 URL-safe random bytes); the registry keeps
``sha256:<hex>`` of it. A key file holds one key on its first non-empty line.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path

from pipeline.errors import LlmqError

_HASH = re.compile(r"sha256:[0-9a-f]{64}")


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def is_key_hash(text: str) -> bool:
    return _HASH.fullmatch(text) is not None


def fingerprint(key_hash: str) -> str:
    """A short, public name for a stored key (for listings): its hash's first 8 hex digits."""
    return key_hash.removeprefix("sha256:")[:8]


def generate_key() -> str:
    return "llmq-" + secrets.token_urlsafe(32)


def read_key_file(path: str | os.PathLike) -> str:
    """The key in ``path``. Errors name the file as given, never its content."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise LlmqError(f"cannot read key file {Path(path).name!r}: {exc.strerror}") from None
    for line in text.splitlines():
        if line.strip():
            key = line.strip()
            if len(key) < 16:
                raise LlmqError(f"key file {Path(path).name!r}: a key needs at least 16 characters")
            return key
    raise LlmqError(f"key file {Path(path).name!r} is empty")


def write_key_file(path: str | os.PathLike, key: str) -> None:
    """Write ``key`` readable by its owner only (created 0600, never world-readable in between)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
