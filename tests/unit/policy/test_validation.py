import pytest

from pipeline.models import Request
from pipeline.policy.validation import validate_request


def test_a_well_formed_request_passes():
    assert validate_request(Request.new("tenant-a", "hello")) is None


@pytest.mark.parametrize("change, fragment", [
    ({"tenant_id": ""}, "tenant_id is empty"),
    ({"tenant_id": "   "}, "tenant_id is empty"),
    ({"tenant_id": "evil\x00tenant"}, "control characters"),
    ({"tenant_id": "t\nx"}, "control characters"),
    ({"tenant_id": "x" * 300}, "longer than"),
    ({"prompt": ""}, "prompt is empty"),
    ({"max_tokens": 0}, "max_tokens must be > 0"),
    ({"max_tokens": -5}, "max_tokens must be > 0"),
    ({"max_tokens": 10**7}, "max_tokens must be <="),
    ({"timeout_ms": -1}, "timeout_ms must be > 0"),
    ({"model": ""}, "model is empty"),
    ({"request_id": "not-a-uuid"}, "request_id must be a UUID"),
    ({"request_id": "zzzzzzzz-zzzz-zzzz-zzzz-zzzzzzzzzzzz"}, "request_id must be a UUID"),
])
def test_invalid_requests_get_a_precise_reason(change, fragment):
    req = Request.new("tenant-a", "hello")
    for k, v in change.items():
        setattr(req, k, v)
    reason = validate_request(req)
    assert reason is not None and reason.startswith("invalid_request: ")
    assert fragment in reason


@pytest.mark.parametrize("tenant", ["tenant\u202egnp.exe", "zero\u200bwidth", "line\u2028sep", "\ufeffbom"])
def test_tenant_ids_with_invisible_or_reordering_characters_are_refused(tenant):
    req = Request.new("x", "hello")
    req.tenant_id = tenant
    assert "control characters" in validate_request(req)


def test_trace_ids_are_short_printable_tokens():
    req = Request.new("tenant-a", "hello", trace_id="4bf92f3577b34da6a3ce929d0e0e4736")
    assert validate_request(req) is None
    req.trace_id = "trace\x1b[2J\n"
    assert validate_request(req).startswith("invalid_request: trace_id")
    req.trace_id = "t" * 129
    assert validate_request(req).startswith("invalid_request: trace_id")


def test_requests_dated_in_the_future_beyond_clock_skew_are_refused():
    req = Request.new("tenant-a", "hello")
    now = req.created_at
    assert validate_request(req, now_ms=now) is None
    req.created_at = now + 60_000  # a minute of skew is tolerated
    assert validate_request(req, now_ms=now) is None
    req.created_at = now + 3_600_000
    assert "in the future" in validate_request(req, now_ms=now)
