"""A stored response: one JSON record per response id in ``<prefix>.stored-responses``, its latest state.

The record holds what the caller asked (input items, instructions, sampling), where its answer
will be (the llmq request id, its reply partition, and the offsets of the responses and chunks
topics' partition when it was submitted: every answer and chunk of it comes after them), and,
once it ended, its output, usage and error. Any serve process can answer for it, replay its
stream, or finish it from the responses topic when the process that submitted it went away.

A newer record replaces an older one (``updated_ms``), but a record that ended is never replaced
by one that has not: two processes finishing the same response write the same answer.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED, INCOMPLETE = (
    "queued", "in_progress", "completed", "failed", "cancelled", "incomplete")
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED, INCOMPLETE})


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def message_id(response_id: str, n: int = 0) -> str:
    return f"msg_{response_id[5:]}" if n == 0 else f"msg_{response_id[5:]}_{n}"


@dataclass
class StoredResponse:
    id: str
    tenant: str
    created_at: int  # epoch seconds
    model: str
    status: str = QUEUED
    #: The caller's input as message items ({"id", "type": "message", "role", "content": [parts]}).
    input: list[dict[str, Any]] = field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None  # as asked
    served_tier: str | None = None
    base_band: str = "NORMAL"
    band: str = "NORMAL"
    request_id: str = ""
    reply_partition: int | None = None
    answers_from: int = 0
    chunks_from: int = 0
    deadline_ms: int = 0
    output_text: str | None = None
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    error: dict[str, str] | None = None
    incomplete_reason: str | None = None
    cancel_asked: bool = False
    updated_ms: int = 0

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "StoredResponse":
        doc = json.loads(data)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in doc.items() if k in known})

    def replaces(self, other: "StoredResponse | None") -> bool:
        """Whether this record should replace ``other`` in an index."""
        if other is None:
            return True
        if other.terminal and not self.terminal:
            return False
        if self.terminal and not other.terminal:
            return True
        return self.updated_ms >= other.updated_ms
