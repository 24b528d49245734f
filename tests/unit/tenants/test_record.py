"""Tenant records: their table format, what is refused (naming the key), and the topic's JSON."""

from __future__ import annotations

import pytest

from pipeline.errors import ConfigError
from pipeline.models import Priority
from pipeline.tenants.keys import hash_key
from pipeline.tenants.record import TenantRecord, from_json, parse_record, parse_records

KEY_HASH = hash_key("a-key-of-sixteen-or-more")


def test_a_full_record_parses_and_round_trips_through_the_topics_json():
    record = parse_record("acme", {
        "tier": "enterprise", "max_priority": "high", "models": ["sim-small", "sim-small", "gpt-4o"], "weight": 2,
        "key_hashes": [KEY_HASH], "require_signature": True, "signing_secret": "env:ACME_SECRET",
        "limits": {"per_second": {"window_ms": 1000, "requests": 50, "tokens": 10_000, "burst": 5}},
        "outstanding": {"NORMAL": 100}, "updated_at": 1234}, "acme")
    assert record.tier == "enterprise" and record.max_priority is Priority.HIGH
    assert record.models == ("sim-small", "gpt-4o")  # de-duplicated, in order
    assert record.weight == 2.0 and record.key_hashes == (KEY_HASH,)
    [limit] = record.limits
    assert (limit.name, limit.window_ms, limit.requests, limit.tokens, limit.burst) == ("per_second", 1000, 50,
                                                                                        10_000, 5)
    assert record.outstanding == {"NORMAL": 100}
    assert from_json("acme", record.to_json()) == record


def test_defaults_leave_the_gateway_in_charge():
    record = parse_record("t", {}, "t")
    assert record == TenantRecord("t")
    assert record.limits is None and record.outstanding == {} and record.models == ()
    assert record.allows_model("anything") and record.cap_priority(Priority.CRITICAL) is Priority.CRITICAL


def test_priority_is_capped_at_the_records_highest_band():
    record = TenantRecord("t", max_priority=Priority.NORMAL)
    assert record.cap_priority(Priority.CRITICAL) is Priority.NORMAL
    assert record.cap_priority(Priority.HIGH) is Priority.NORMAL
    assert record.cap_priority(Priority.LOW) is Priority.LOW


@pytest.mark.parametrize("spec, key", [
    ({"tier": ""}, "t.tier"),
    ({"max_priority": "URGENT"}, "t.max_priority"),
    ({"models": "sim-small"}, "t.models"),
    ({"weight": 0}, "t.weight"),
    ({"weight": True}, "t.weight"),
    ({"key_hashes": ["the-key-itself"]}, "t.key_hashes"),
    ({"require_signature": "yes"}, "t.require_signature"),
    ({"signing_secret": "hunter2"}, "t.signing_secret"),
    ({"require_signature": True}, "t.signing_secret"),
    ({"limits": {"x": {"window_ms": 0, "requests": 1}}}, "t.limits.x.window_ms"),
    ({"limits": {}}, "t.limits"),
    ({"outstanding": {"URGENT": 1}}, "t.outstanding.URGENT"),
    ({"outstanding": {"HIGH": -1}}, "t.outstanding.HIGH"),
    ({"colour": "red"}, "t.colour"),
    ({"v": 2}, "t.v"),
])
def test_invalid_records_are_refused_naming_the_key(spec, key):
    with pytest.raises(ConfigError) as err:
        parse_record("t", spec, "t")
    assert err.value.key == key


def test_a_secret_given_in_place_of_its_reference_is_never_quoted():
    with pytest.raises(ConfigError) as err:
        parse_record("t", {"signing_secret": "s3cr3t-value"}, "t")
    assert "s3cr3t-value" not in str(err.value)


@pytest.mark.parametrize("name", ["", " ", "a\x00b", "x" * 300])
def test_tenant_names_follow_the_tenant_id_rules(name):
    with pytest.raises(ConfigError):
        parse_record(name, {}, "t")


def test_records_of_a_table_and_bad_json():
    records = parse_records({"a": {"tier": "free"}, "b": {}}, "tenants.records")
    assert set(records) == {"a", "b"} and records["a"].tier == "free"
    with pytest.raises(ConfigError):
        from_json("a", b"{not json")
    with pytest.raises(ConfigError):
        parse_records(["a"], "tenants.records")
