"""An input file's lines, checked; the output and error files' lines. Pure, no I/O.

An input line is OpenAI's ``{"custom_id", "method": "POST", "url", "body"}``, its body that of
the batch's endpoint (checked by :func:`pipeline.openai_api.chat.parse_body`, the same rules as
``llmq serve``'s own endpoints). A line that fails is not a failed batch: it goes to the error
file with its reason, and the other lines run.

Output lines follow OpenAI's: ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}``, in the input's order. A line answered with an error (refused, failed) has
its HTTP status and OpenAI error body in ``response``; a line that never ran (invalid, expired,
cancelled) has ``response: null`` and ``error: {"code", "message"}``.

Each line's request id is derived from the batch id, its line number and its attempt, so a
driver that starts over (after a crash) names the same requests: the gateway answers a
re-sent id once, and the driver keeps the first answer per line.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from pipeline.models import Response, Status
from pipeline.openai_api.chat import CHAT, COMPLETION, Parsed, parse_body, render
from pipeline.openai_api.errors import ApiError, for_response, reason_code

_NAMESPACE = uuid.UUID("5b0c1a8e-7d2f-4c1e-9a43-6f1d2b8c9e10")
#: Refusals that say "later", not "no": the line is sent again (a new attempt) after the wait.
RETRYABLE = frozenset({"rate_limited", "queue_full", "quota_exceeded", "overloaded"})
MAX_CUSTOM_ID = 512


def kind_of(endpoint: str) -> str:
    return CHAT if endpoint == "/v1/chat/completions" else COMPLETION


def line_request_id(batch_id: str, line: int, attempt: int) -> str:
    return str(uuid.uuid5(_NAMESPACE, f"{batch_id}:{line}:{attempt}"))


@dataclass
class Line:
    """A line of the input: ``parsed`` when it is a valid request, else ``error``."""

    index: int
    custom_id: str
    parsed: Parsed | None = None
    error: str | None = None


def split_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(index, text) of each non-blank line; the index counts blank lines too."""
    for i, raw in enumerate(data.split(b"\n")):
        if raw.strip():
            yield i, raw


def parse_lines(data: bytes, endpoint: str, default_max_tokens: int) -> list[Line]:
    """Every non-blank line of the file, checked. custom_id must be unique in the file: a
    repeat is an error line of its own (its answer could not be told apart)."""
    kind = kind_of(endpoint)
    out: list[Line] = []
    ids: set[str] = set()
    for n, (index, raw) in enumerate(split_lines(data)):
        line = _parse(index, raw, endpoint, kind, default_max_tokens)
        if not line.custom_id:
            line.custom_id = f"line-{index + 1}"
        elif line.custom_id in ids:
            line.parsed, line.error = None, f"invalid_request: custom_id {line.custom_id!r} repeats an earlier line's"
        ids.add(line.custom_id)
        line.index = n
        out.append(line)
    return out


def _parse(index: int, raw: bytes, endpoint: str, kind: str, default_max_tokens: int) -> Line:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return Line(index, "", error=f"invalid_request: line {index + 1} is not valid JSON")
    if not isinstance(doc, dict):
        return Line(index, "", error=f"invalid_request: line {index + 1} is not a JSON object")
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return Line(index, "", error=f"invalid_request: line {index + 1}: custom_id must be a string of 1-"
                                     f"{MAX_CUSTOM_ID} characters")
    if doc.get("method", "POST") != "POST":
        return Line(index, custom_id, error="invalid_request: method must be POST")
    if doc.get("url") != endpoint:
        return Line(index, custom_id, error=f"invalid_request: url must be the batch's endpoint {endpoint}")
    try:
        parsed = parse_body(doc.get("body"), kind, default_max_tokens)
    except ApiError as exc:
        return Line(index, custom_id, error=exc.message if ":" in exc.message else f"invalid_request: {exc.message}")
    if parsed.stream:
        return Line(index, custom_id, error="invalid_request: stream is not available in a batch")
    return Line(index, custom_id, parsed)


# -- answers ---------------------------------------------------------------------------------


def retryable(resp: Response, window_open: bool) -> bool:
    """Whether ``resp`` says to send the line again: a refusal for now, or a line that expired
    on its own deadline while the batch's window is still open."""
    if resp.status is Status.REJECTED:
        return reason_code(resp.reason) in RETRYABLE
    return resp.status is Status.EXPIRED and window_open


def _line_id(request_id: str) -> str:
    return f"batch_req_{request_id.replace('-', '')}"


def output_line(line: Line, resp: Response, endpoint: str) -> dict[str, Any]:
    """The line of the output file (COMPLETED) or of the error file (any other answer)."""
    kind = kind_of(endpoint)
    model = line.parsed.model if line.parsed else ""
    error = for_response(resp)
    if error is None:
        status, body = 200, render(kind, resp, model)
    else:
        status, body = error.status, error.body()
    return {"id": _line_id(resp.request_id), "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": resp.request_id, "body": body}, "error": None}


def error_line(line: Line, request_id: str, code: str, message: str) -> dict[str, Any]:
    """A line that did not run: invalid, expired with the window, or cancelled."""
    return {"id": _line_id(request_id), "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}


def jsonl(docs: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(d, separators=(",", ":")).encode() + b"\n" for d in docs)
