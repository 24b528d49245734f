"""authorize(): the tier is the registry's, priorities are capped, models checked, signatures verified."""

from __future__ import annotations

import pytest

from pipeline.models import Priority, Request
from pipeline.serde import Codec
from pipeline.tenants.policy import TenantPolicy, authorize, cap_priority
from pipeline.tenants.record import TenantRecord
from pipeline.tenants.signing import sign

SECRET = b"tenant-secret-bytes"
NOW = 1_800_000_000_000


def _request(tenant="acme", **kw) -> Request:
    kw.setdefault("created_at", NOW)
    return Request.new(tenant, "hello", **kw)


def test_an_unknown_tenant_is_served_standard_whatever_the_body_claims():
    req = _request("stranger", user_tier="enterprise", priority=Priority.CRITICAL)
    auth = authorize(req, None, None, NOW)
    assert auth.problem is None and auth.record is None
    assert auth.request.user_tier == "standard" and auth.request.priority is Priority.CRITICAL
    assert req.user_tier == "enterprise"  # the input is left as it was
    assert any("tier standard" in note for note in auth.notes)


def test_unknown_tenants_are_refused_when_the_registry_must_know_them():
    auth = authorize(_request("stranger"), None, None, NOW, policy=TenantPolicy(require_known=True))
    assert auth.problem.startswith("unauthorized: tenant 'stranger' is not registered")


def test_the_default_for_unknown_tenants_can_cap_their_priority_and_name_their_tier():
    policy = TenantPolicy(default_tier="free", default_max_priority=Priority.NORMAL)
    auth = authorize(_request("stranger", priority=Priority.HIGH), None, None, NOW, policy=policy)
    assert auth.request.user_tier == "free" and auth.request.priority is Priority.NORMAL
    assert cap_priority(None, Priority.CRITICAL, policy) is Priority.NORMAL


def test_a_known_tenant_gets_its_records_tier_and_band_cap():
    record = TenantRecord("acme", tier="free", max_priority=Priority.NORMAL)
    auth = authorize(_request(user_tier="enterprise", priority=Priority.CRITICAL), record, None, NOW)
    assert auth.problem is None and auth.record is record
    assert auth.request.user_tier == "free" and auth.request.priority is Priority.NORMAL
    assert "priority capped CRITICAL -> NORMAL" in auth.notes
    lower = authorize(_request(user_tier="free", priority=Priority.LOW), record, None, NOW)
    assert lower.request.priority is Priority.LOW and lower.notes == ()


def test_a_model_outside_the_records_list_is_forbidden():
    record = TenantRecord("acme", models=("sim-small",))
    assert authorize(_request(model="sim-small"), record, None, NOW).problem is None
    auth = authorize(_request(model="sim-large"), record, None, NOW)
    assert auth.problem.startswith("forbidden: model 'sim-large' is not allowed for tenant 'acme'")


def test_a_disabled_tenant_is_refused():
    auth = authorize(_request(), TenantRecord("acme", enabled=False), None, NOW)
    assert auth.problem == "unauthorized: tenant 'acme' is disabled"


# -- signed requests ------------------------------------------------------------------------------

SIGNED = TenantRecord("acme", require_signature=True, signing_secret="env:ACME")


def _signed(req: Request, secret: bytes = SECRET) -> tuple[bytes, list]:
    raw = Codec.default().encode_request(req)
    return raw, [("llmq-signature", sign(secret, raw).encode())]


def test_a_signed_request_with_the_tenants_secret_passes():
    req = _request()
    raw, headers = _signed(req)
    auth = authorize(req, SIGNED, headers, NOW + 1000, raw=raw, secret=SECRET)
    assert auth.problem is None


@pytest.mark.parametrize("case", ["unsigned", "other secret", "tampered", "no secret here", "garbage header"])
def test_unsigned_or_badly_signed_requests_are_refused_unauthorized(case):
    req = _request()
    raw, headers = _signed(req, b"another-tenants-secret" if case == "other secret" else SECRET)
    secret = SECRET
    if case == "unsigned":
        headers = []
    if case == "tampered":
        raw = Codec.default().encode_request(_request(priority=Priority.CRITICAL, request_id=req.request_id))
    if case == "no secret here":
        secret = None
    if case == "garbage header":
        headers = [("llmq-signature", b"\xff\xfe")]
    auth = authorize(req, SIGNED, headers, NOW, raw=raw, secret=secret)
    assert auth.problem is not None and auth.problem.startswith("unauthorized: ")
    assert SECRET.decode() not in auth.problem


def test_a_signature_is_accepted_only_near_its_creation_time():
    req = _request()
    raw, headers = _signed(req)
    policy = TenantPolicy(signature_max_age_ms=60_000)
    assert authorize(req, SIGNED, headers, NOW + 59_000, raw=raw, secret=SECRET, policy=policy).problem is None
    late = authorize(req, SIGNED, headers, NOW + 61_000, raw=raw, secret=SECRET, policy=policy)
    assert late.problem.startswith("unauthorized: signed request created 61s ago")


def test_headers_in_every_shape_and_a_rotation_pair_of_signatures():
    req = _request()
    raw, _ = _signed(req)
    both = f"v1={'0' * 64}, {sign(SECRET, raw)}"
    for headers in ({"llmq-signature": both}, [("LLMQ-Signature", both.encode())], [(b"llmq-signature", both)]):
        assert authorize(req, SIGNED, headers, NOW, raw=raw, secret=SECRET).problem is None


def test_signatures_are_not_asked_of_tenants_that_do_not_require_them():
    auth = authorize(_request(), TenantRecord("acme"), [("llmq-signature", b"v1=bad")], NOW)
    assert auth.problem is None
