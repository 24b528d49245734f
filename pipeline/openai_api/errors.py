"""HTTP errors in OpenAI's shape, and which status each of the pipeline's answers gets.

Every error body is ``{"error": {"message", "type", "param", "code"}}``, as OpenAI's API and its
client libraries expect. A refused or failed request says why with the pipeline's own reason
(``rate_limited: limit per_second: ...``), whose text never holds a server path or a secret.

| pipeline answer                                   | HTTP | type / code                            |
|---------------------------------------------------|------|----------------------------------------|
| REJECTED rate_limited                             | 429  | rate_limit_error / rate_limit_exceeded |
| REJECTED queue_full, quota_exceeded               | 429  | rate_limit_error / queue_full, ...     |
| REJECTED invalid_request, response_too_large      | 400  | invalid_request_error / the code       |
| REJECTED unauthorized                             | 401  | authentication_error / unauthorized    |
| REJECTED forbidden                                | 403  | permission_error / forbidden           |
| REJECTED duplicate_request_id                     | 409  | invalid_request_error / duplicate_...  |
| REJECTED model_not_found, model_unavailable       | 404  | invalid_request_error / model_not_found|
| EXPIRED                                           | 504  | timeout / expired                      |
| CANCELLED                                         | 409  | cancelled / cancelled                  |
| FAILED                                            | 502  | api_error / the code (backend_error)   |

429s (and any answer with ``retry_after_ms``) carry ``Retry-After`` in whole seconds, rounded up.
"""

from __future__ import annotations

import json

from pipeline.models import Response, Status

_TOO_MANY = {"rate_limited": "rate_limit_exceeded", "queue_full": "queue_full", "quota_exceeded": "quota_exceeded",
             "overloaded": "overloaded"}
_REJECTED = {
    "invalid_request": (400, "invalid_request_error"),
    "response_too_large": (400, "invalid_request_error"),
    "unauthorized": (401, "authentication_error"),
    "forbidden": (403, "permission_error"),
    "duplicate_request_id": (409, "invalid_request_error"),
    "model_unavailable": (404, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),
}


def retry_after_seconds(retry_after_ms: int | None) -> int | None:
    if not retry_after_ms or retry_after_ms <= 0:
        return None
    return max(1, -(-retry_after_ms // 1000))


class ApiError(Exception):
    """An error answer: its status, OpenAI error fields and extra headers."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_json(self) -> bytes:
        return json.dumps(self.body()).encode()

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else {}


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def reason_code(reason: str | None) -> str:
    return (reason or "").split(":", 1)[0].strip().lower()


def for_reason(reason: str, retry_after_ms: int | None = None) -> ApiError:
    """A refusal (REJECTED) or an early check's problem, by its reason code."""
    code = reason_code(reason)
    retry = retry_after_seconds(retry_after_ms)
    if code in _TOO_MANY:
        return ApiError(429, reason, "rate_limit_error", _TOO_MANY[code], retry_after_s=retry or 1)
    status, type_ = _REJECTED.get(code, (400, "invalid_request_error"))
    if code in ("model_unavailable", "model_not_found"):
        return ApiError(status, reason, type_, "model_not_found", "model", retry)
    return ApiError(status, reason, type_, code or None, retry_after_s=retry)


def for_response(resp: Response) -> ApiError | None:
    """None for a COMPLETED answer, else its error."""
    status = resp.status
    if status is Status.COMPLETED:
        return None
    reason = resp.reason or status.value.lower()
    retry = retry_after_seconds(resp.retry_after_ms)
    if status is Status.REJECTED:
        return for_reason(reason, resp.retry_after_ms)
    if status is Status.EXPIRED:
        return ApiError(504, reason, "timeout", "expired", retry_after_s=retry)
    if status is Status.CANCELLED:
        return ApiError(409, reason, "cancelled", "cancelled")
    return ApiError(502, reason, "api_error", reason_code(reason) or "failed", retry_after_s=retry)
