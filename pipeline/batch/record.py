"""A batch's state, as stored in the batches topic and shown by ``GET /v1/batches/{id}``. Pure.

One JSON record per batch id holds its latest state. ``llmq serve`` writes the first
(``validating``) when the batch is created; from then on only the batch's driver writes it (the
member of the batch group that owns its partition), so two writers never race. A cancel is a
record of its own (:func:`cancel_key`), which the driver reads and acts on.

Life: validating → in_progress → finalizing → completed; or failed (the input file cannot be
read), expired (the window closed with lines unanswered), cancelling → cancelled.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any

VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
FAILED, EXPIRED, CANCELLING, CANCELLED = "failed", "expired", "cancelling", "cancelled"
TERMINAL = frozenset({COMPLETED, FAILED, EXPIRED, CANCELLED})
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
_WINDOW = re.compile(r"^(\d+)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def window_seconds(text: Any, longest_s: int) -> int:
    """``"24h"`` → 86400; ValueError says what is accepted."""
    match = _WINDOW.match(text) if isinstance(text, str) else None
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)] if match else 0
    if not 0 < seconds <= longest_s:
        raise ValueError(f"completion_window must be a duration such as \"24h\" of at most {longest_s} s")
    return seconds


def cancel_key(batch_id: str) -> str:
    return f"{batch_id}/cancel"


class _Json:
    """A record as its topic holds it: JSON of its fields; fields it does not know are dropped
    (written by a newer llmq), fields missing take their defaults (an older one)."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes):
        doc = json.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})


@dataclass
class BatchRecord(_Json):
    id: str
    tenant: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int  # epoch seconds, as OpenAI's objects
    expires_at: int
    priority: str = "BACKGROUND"
    metadata: dict[str, str] = field(default_factory=dict)
    status: str = VALIDATING
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    #: Where the driver starts reading the answers: the reply partition its lines name, and
    #: that partition's end when the batch started (kept so a new driver reads them all again).
    reply_partition: int = 0
    answers_from: int = -1

    @property
    def ended_at(self) -> int | None:
        return self.completed_at or self.failed_at or self.expired_at or self.cancelled_at

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def view(self, cancel_asked_at: int | None = None) -> dict[str, Any]:
        """OpenAI's batch object. A cancel asked for and not yet acted on shows as cancelling."""
        status, cancelling_at = self.status, self.cancelling_at
        if cancel_asked_at is not None and not self.terminal and status != CANCELLING:
            status, cancelling_at = CANCELLING, cancel_asked_at
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window, "status": status,
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": self.in_progress_at, "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at, "completed_at": self.completed_at, "failed_at": self.failed_at,
            "expired_at": self.expired_at, "cancelling_at": cancelling_at, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata or None,
        }


@dataclass
class FileRecord(_Json):
    """A file's metadata record; its bytes are ``chunks`` records of the files topic."""

    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    chunks: int
    lines: int = 0
    #: Result files: the batch they belong to (deleted with it).
    batch_id: str | None = None

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def result_file_id(batch_id: str, kind: str) -> str:
    """The output (``kind`` "output") or error file's id: fixed by the batch, so a driver that
    finalizes the batch again writes the same file."""
    return f"file-{batch_id.removeprefix('batch_')}-{kind}"
