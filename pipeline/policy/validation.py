"""Request validation: pure, no I/O. Used by workers (gateway-less mode) and the gateway.

Returns the rejection reason (``invalid_request: ...``) or None. Headers never reach
this code: tenant and priority come only from the decoded, schema-checked body.
"""

from __future__ import annotations

import functools
import re

from pipeline.models import Request

MAX_TENANT_ID_CHARS = 256
MAX_TOKENS_LIMIT = 1_000_000
# C0/C1 controls, and Unicode format/separator characters that reorder or hide text
# (bidi overrides, zero-width, line/paragraph separators, BOM).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")
MAX_TRACE_ID_CHARS = 128
_TRACE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,%d}" % MAX_TRACE_ID_CHARS)
#: How far in the future a client's clock may put created_at before the request is refused.
MAX_CLOCK_SKEW_MS = 5 * 60 * 1000
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_UUID_MATCH = _UUID.fullmatch


@functools.lru_cache(maxsize=4096)
def _tenant_problem(tenant: str) -> str | None:
    # Cached: the same tenants send request after request.
    if not tenant or not tenant.strip():
        return "invalid_request: tenant_id is empty"
    if len(tenant) > MAX_TENANT_ID_CHARS:
        return f"invalid_request: tenant_id is longer than {MAX_TENANT_ID_CHARS} characters"
    if _CONTROL.search(tenant):
        return "invalid_request: tenant_id contains control characters"
    return None


def validate_request(req: Request, now_ms: int | None = None) -> str | None:
    problem = _tenant_problem(req.tenant_id)
    if problem is not None:
        return problem
    if not req.prompt:
        return "invalid_request: prompt is empty"
    if req.max_tokens <= 0:
        return f"invalid_request: max_tokens must be > 0 (got {req.max_tokens})"
    if req.max_tokens > MAX_TOKENS_LIMIT:
        return f"invalid_request: max_tokens must be <= {MAX_TOKENS_LIMIT} (got {req.max_tokens})"
    if req.timeout_ms <= 0:
        return f"invalid_request: timeout_ms must be > 0 (got {req.timeout_ms})"
    if not req.model:
        return "invalid_request: model is empty"
    if _UUID_MATCH(req.request_id) is None:
        return "invalid_request: request_id must be a UUID"
    if req.trace_id is not None and _TRACE_ID.fullmatch(req.trace_id) is None:
        return "invalid_request: trace_id must be 1-128 characters of A-Z a-z 0-9 . _ : -"
    if now_ms is not None and req.created_at > now_ms + MAX_CLOCK_SKEW_MS:
        return (f"invalid_request: created_at is {(req.created_at - now_ms) // 1000}s in the future "
                "(client clock skew?)")
    return None
