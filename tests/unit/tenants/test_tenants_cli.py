"""`llmq tenants set`: flags change only what they name; limits and caps parse; keys become hashes."""

from __future__ import annotations

import pytest

from pipeline.cli import build_parser
from pipeline.errors import ConfigError, LlmqError
from pipeline.models import Priority
from pipeline.tenants.cli import build_record, parse_limit
from pipeline.tenants.keys import hash_key
from pipeline.tenants.record import TenantRecord


def _args(*argv):
    return build_parser().parse_args(["tenants", "set", "acme", *argv])


def test_set_builds_a_record_from_flags(tmp_path):
    key = tmp_path / "acme.key"
    key.write_text("llmq-a-long-enough-key\n")
    args = _args("--tier", "enterprise", "--max-priority", "high", "--model", "sim-small", "--limit",
                 "per_second:window_ms=1000,requests=5,tokens=900", "--outstanding", "normal=10", "--weight", "3",
                 "--key-file", str(key))
    record = build_record(None, "acme", args)
    assert record.tier == "enterprise" and record.max_priority is Priority.HIGH and record.models == ("sim-small",)
    assert [(lim.name, lim.requests, lim.tokens) for lim in record.limits] == [("per_second", 5, 900)]
    assert record.outstanding == {"NORMAL": 10} and record.weight == 3.0
    assert record.key_hashes == (hash_key("llmq-a-long-enough-key"),) and record.updated_at > 0


def test_set_keeps_what_its_flags_do_not_name(tmp_path):
    current = TenantRecord("acme", tier="enterprise", models=("m",), key_hashes=(hash_key("k" * 20),),
                           outstanding={"HIGH": 5})
    record = build_record(current, "acme", _args("--outstanding", "NORMAL=7"))
    assert record.tier == "enterprise" and record.models == ("m",) and record.key_hashes == current.key_hashes
    assert record.outstanding == {"HIGH": 5, "NORMAL": 7}
    assert build_record(current, "acme", _args("--revoke-keys", "--any-model")).key_hashes == ()
    assert build_record(current, "acme", _args("--replace")).tier == "standard"
    assert build_record(current, "acme", _args("--disable")).enabled is False


def test_signed_requests_need_a_secret_reference():
    with pytest.raises(ConfigError):
        build_record(None, "acme", _args("--require-signature"))
    record = build_record(None, "acme", _args("--require-signature", "--signing-secret", "env:ACME"))
    assert record.require_signature and record.signing_secret == "env:ACME"


@pytest.mark.parametrize("text", ["per_second", "per_second:", "x:window_ms", "x:window_ms=soon"])
def test_malformed_limits_are_refused(text):
    with pytest.raises(ConfigError):
        parse_limit(text)


def test_a_missing_key_file_is_an_error_without_its_directory(tmp_path):
    with pytest.raises(LlmqError) as err:
        build_record(None, "acme", _args("--key-file", str(tmp_path / "nope.key")))
    assert str(tmp_path) not in str(err.value)
