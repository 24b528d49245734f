"""API keys (hashes only, key files) and signing secrets (references, resolved safely)."""

from __future__ import annotations

import os
import stat

import pytest

from pipeline.errors import LlmqError
from pipeline.tenants.keys import fingerprint, generate_key, hash_key, is_key_hash, read_key_file, write_key_file
from pipeline.tenants.signing import SecretError, resolve_secret, sign, verify


def test_keys_are_stored_as_sha256_hashes():
    key = generate_key()
    assert key.startswith("llmq-") and len(key) > 40 and generate_key() != key
    h = hash_key(key)
    assert is_key_hash(h) and key not in h and len(fingerprint(h)) == 8


def test_key_files_are_read_and_written_owner_only(tmp_path):
    path = tmp_path / "acme.key"
    write_key_file(path, "llmq-0123456789abcdef")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_key_file(path) == "llmq-0123456789abcdef"
    with pytest.raises(FileExistsError):
        write_key_file(path, "another")  # never overwrites a key


def test_key_file_errors_name_the_file_not_its_directory_or_content(tmp_path):
    short = tmp_path / "short.key"
    short.write_text("tiny\n")
    with pytest.raises(LlmqError) as err:
        read_key_file(short)
    assert "tiny" not in str(err.value) and str(tmp_path) not in str(err.value)
    with pytest.raises(LlmqError) as err:
        read_key_file(tmp_path / "missing.key")
    assert str(tmp_path) not in str(err.value)


def test_sign_and_verify():
    sig = sign(b"k", b"body")
    assert sig.startswith("v1=") and verify(b"k", b"body", sig)
    assert not verify(b"k", b"body!", sig) and not verify(b"other", b"body", sig)
    assert not verify(b"k", b"body", "v0=" + sig[3:]) and not verify(b"k", b"body", "")


def test_secret_references_from_the_environment_and_the_secrets_dir(tmp_path):
    (tmp_path / "acme.secret").write_bytes(b"file-secret\n")
    assert resolve_secret("env:ACME", "", {"ACME": "env-secret"}) == b"env-secret"
    assert resolve_secret("file:acme.secret", str(tmp_path), {}) == b"file-secret"


@pytest.mark.parametrize("ref", ["file:../etc/passwd", "file:/etc/passwd", "file:.hidden", "file:a/b", "plain",
                                 "env:", "file:missing", "env:UNSET"])
def test_unresolvable_or_escaping_references_are_refused_without_paths(ref, tmp_path):
    with pytest.raises(SecretError) as err:
        resolve_secret(ref, str(tmp_path), {})
    assert str(tmp_path) not in str(err.value)


def test_file_references_need_a_secrets_dir():
    with pytest.raises(SecretError):
        resolve_secret("file:acme.secret", "", {})
