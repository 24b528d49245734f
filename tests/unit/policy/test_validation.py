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
