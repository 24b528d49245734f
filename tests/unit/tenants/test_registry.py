"""The registry without a broker: where records come from, keys, live snapshots, secrets."""

from __future__ import annotations

import threading

import pytest

from pipeline.config import Settings
from pipeline.errors import ConfigError
from pipeline.models import Priority, Request
from pipeline.serde import Codec
from pipeline.tenants.keys import hash_key
from pipeline.tenants.record import TenantRecord
from pipeline.tenants.registry import TenantRegistry
from pipeline.tenants.signing import sign

KEY_A, KEY_B = "key-of-tenant-a-0001", "key-of-tenant-b-0002"


def _settings(tmp_path, file_text: str | None = None, **tenants) -> Settings:
    s = Settings.load(env={})
    if file_text is not None:
        path = tmp_path / "tenants.toml"
        path.write_text(file_text)
        s.tenants.file = str(path)
    for k, v in tenants.items():
        setattr(s.tenants, k, v)
    return s


def _put(registry: TenantRegistry, record: TenantRecord | None, name: str | None = None) -> bool:
    name = name or record.name
    return registry.apply([(name.encode(), None if record is None else record.to_json())])


def test_the_file_wins_over_inline_records_and_the_topic_over_both(tmp_path):
    s = _settings(tmp_path, '[acme]\ntier = "enterprise"\n[beta]\ntier = "free"\n',
                  records={"acme": {"tier": "standard"}, "gamma": {"tier": "free"}})
    registry = TenantRegistry(s)
    assert registry.get("acme").tier == "enterprise" and registry.source("acme") == "file"
    assert registry.get("gamma").tier == "free" and registry.get("nobody") is None
    assert _put(registry, TenantRecord("acme", tier="free"))
    assert registry.get("acme").tier == "free" and registry.source("acme") == "topic"
    # A tombstone drops the topic's record: the file's applies again.
    assert _put(registry, None, "acme")
    assert registry.get("acme").tier == "enterprise" and registry.version == 2


def test_a_bad_registry_file_is_a_config_error_naming_only_the_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        TenantRegistry(_settings(tmp_path, "[acme\n"))
    assert str(tmp_path) not in str(err.value)
    with pytest.raises(ConfigError) as err:
        TenantRegistry(_settings(tmp_path, '[acme]\nmax_priority = "URGENT"\n'))
    assert "max_priority" in err.value.key


def test_keys_find_their_tenant_by_hash_and_revocation_is_immediate(tmp_path):
    registry = TenantRegistry(_settings(tmp_path))
    _put(registry, TenantRecord("a", key_hashes=(hash_key(KEY_A),)))
    _put(registry, TenantRecord("b", key_hashes=(hash_key(KEY_B),)))
    assert registry.by_key(KEY_A).name == "a" and registry.by_key(KEY_B).name == "b"
    assert registry.by_key("not-a-registered-key") is None
    _put(registry, TenantRecord("a", key_hashes=()))
    assert registry.by_key(KEY_A) is None
    _put(registry, TenantRecord("b", key_hashes=(hash_key(KEY_B),), enabled=False))
    assert registry.by_key(KEY_B) is None  # a disabled tenant's keys are refused


def test_a_key_registered_to_two_tenants_works_for_neither(tmp_path):
    registry = TenantRegistry(_settings(tmp_path))
    _put(registry, TenantRecord("a", key_hashes=(hash_key(KEY_A),)))
    _put(registry, TenantRecord("b", key_hashes=(hash_key(KEY_A),)))
    assert registry.by_key(KEY_A) is None


def test_an_unparsable_topic_record_leaves_the_tenant_its_record(tmp_path):
    registry = TenantRegistry(_settings(tmp_path))
    _put(registry, TenantRecord("a", tier="enterprise"))
    assert not registry.apply([(b"a", b'{"tier": 7}'), (b"a", b"garbage"), (None, b"{}"), (b"\xff", b"{}")])
    assert registry.get("a").tier == "enterprise"


def test_listeners_hear_each_snapshot(tmp_path):
    registry = TenantRegistry(_settings(tmp_path))
    heard = []
    registry.on_change(lambda: heard.append(registry.get("a").tier))
    registry.on_change(lambda: 1 / 0)  # a broken listener changes nothing for the others
    _put(registry, TenantRecord("a", tier="free"))
    assert heard == ["free"]


def test_readers_never_see_a_half_applied_snapshot(tmp_path):
    registry = TenantRegistry(_settings(tmp_path))
    stop = threading.Event()
    seen_bad = []

    def reader():
        while not stop.is_set():
            record = registry.by_key(KEY_A)
            if record is not None and hash_key(KEY_A) not in record.key_hashes:
                seen_bad.append(record)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(300):
        _put(registry, TenantRecord("a", tier=f"t{i}", key_hashes=(hash_key(KEY_A),) if i % 2 else ()))
    stop.set()
    thread.join()
    assert not seen_bad


def test_authorize_uses_the_live_record_and_its_resolved_secret(tmp_path):
    registry = TenantRegistry(_settings(tmp_path, require_known=True), env={"ACME_SECRET": "s3cret"})
    req = Request.new("acme", "hi", priority=Priority.CRITICAL, user_tier="enterprise")
    assert registry.authorize(req).problem.startswith("unauthorized: tenant 'acme' is not registered")
    _put(registry, TenantRecord("acme", max_priority=Priority.HIGH, require_signature=True,
                                signing_secret="env:ACME_SECRET"))
    raw = Codec.default().encode_request(req)
    assert registry.authorize(req, [], raw).problem.startswith("unauthorized: tenant 'acme' requires signed")
    auth = registry.authorize(req, [("llmq-signature", sign(b"s3cret", raw).encode())], raw)
    assert auth.problem is None and auth.request.priority is Priority.HIGH and auth.request.user_tier == "standard"


def test_a_secret_that_cannot_be_resolved_refuses_signed_requests(tmp_path):
    registry = TenantRegistry(_settings(tmp_path), env={})
    _put(registry, TenantRecord("acme", require_signature=True, signing_secret="env:MISSING"))
    req = Request.new("acme", "hi")
    raw = Codec.default().encode_request(req)
    auth = registry.authorize(req, [("llmq-signature", sign(b"", raw).encode())], raw)
    assert auth.problem.startswith("unauthorized: the signing secret of tenant 'acme' is not available")
