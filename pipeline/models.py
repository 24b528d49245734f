"""In-memory records of llmq: requests, responses and their enums.

The dataclasses mirror the Avro schemas in ``schemas/`` field for field (same names,
same defaults). Timestamps stay plain ``int`` epoch milliseconds, exactly as they are
on the wire, and enums are ``str`` enums whose value is the Avro symbol, so converting
to and from the record dicts fastavro reads and writes is a handful of dict look-ups.

``to_record``/``from_record`` sit on the hot path (every message produced or
consumed), which is why they are written out field by field instead of going through
``dataclasses.asdict`` or ``**record``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

__all__ = [
    "BANDS",
    "LOWEST_RANK",
    "Priority",
    "Status",
    "TERMINAL_STATUSES",
    "TaskTier",
    "Request",
    "Response",
    "now_ms",
]


def now_ms() -> int:
    """Current wall-clock time as integer epoch milliseconds (UTC)."""
    return time.time_ns() // 1_000_000


class _SymbolEnum(str, Enum):
    """A ``str`` enum whose values are Avro enum symbols (value == name)."""

    def __str__(self) -> str:
        return self._value_

    def __format__(self, format_spec: str) -> str:
        return format(self._value_, format_spec)

    @classmethod
    def parse(cls, text: Any):
        """Return the member named ``text`` (case-insensitive, surrounding blanks ignored).

        A member is returned unchanged. Anything else raises ``ValueError`` listing the
        valid names.
        """
        if isinstance(text, cls):
            return text
        if isinstance(text, str):
            member = cls.__members__.get(text.strip().upper())
            if member is not None:
                return member
        valid = ", ".join(cls.__members__)
        raise ValueError(f"invalid {cls.__name__} {text!r}; valid values: {valid}")


class Priority(_SymbolEnum):
    """Requested service band, highest first; ``rank`` is 0 (CRITICAL) .. 4 (BACKGROUND).

    Compare priorities by ``rank``, never with ``<`` on the members themselves: they are
    strings, so ``<`` is alphabetical.
    """

    rank: int

    CRITICAL = "CRITICAL"
    HIGH = "HIGH"
    NORMAL = "NORMAL"
    LOW = "LOW"
    BACKGROUND = "BACKGROUND"


# A plain instance attribute is the cheapest thing to read in a scheduler loop.
for _rank, _member in enumerate(Priority):
    _member.rank = _rank
del _rank, _member

#: The bands by rank: ``BANDS[0]`` is CRITICAL, ``BANDS[-1]`` BACKGROUND.
BANDS: tuple[Priority, ...] = tuple(Priority)
#: The lowest band's rank, where work of an unknown band is put.
LOWEST_RANK = len(BANDS) - 1


class Status(_SymbolEnum):
    """State of a request as reported on the response topic.

    Every symbol but ``QUEUED`` is a terminal outcome (exactly one per request);
    ``QUEUED`` is a progress event that may come any number of times before it.
    ``is_terminal`` tells them apart; so does membership of :data:`TERMINAL_STATUSES`.
    """

    is_terminal: bool

    COMPLETED = "COMPLETED"
    REJECTED = "REJECTED"
    EXPIRED = "EXPIRED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    QUEUED = "QUEUED"


#: The statuses that end a request; a client waiting for the answer waits for one of these.
TERMINAL_STATUSES: frozenset[Status] = frozenset(m for m in Status if m is not Status.QUEUED)

# An attribute, like Priority.rank: read per response by every client listener.
for _member in Status:
    _member.is_terminal = _member in TERMINAL_STATUSES
del _member


class TaskTier(_SymbolEnum):
    """Kind of work, used to pick a worker pool."""

    REALTIME = "REALTIME"
    ASYNC = "ASYNC"
    BACKGROUND = "BACKGROUND"


# symbol -> member; a dict look-up is several times cheaper than calling the Enum.
_PRIORITY_BY_SYMBOL: dict[str, Priority] = {m._value_: m for m in Priority}
_STATUS_BY_SYMBOL: dict[str, Status] = {m._value_: m for m in Status}
_TASK_TIER_BY_SYMBOL: dict[str, TaskTier] = {m._value_: m for m in TaskTier}


def _symbol_error(enum_cls: type[Enum], field_name: str, value: Any) -> ValueError:
    valid = ", ".join(enum_cls.__members__)
    return ValueError(f"field {field_name}: unknown {enum_cls.__name__} symbol {value!r} (valid: {valid})")


@dataclass(slots=True)
class Request:
    """One LLM inference request (Avro record ``io.llmq.v1.LLMRequest``).

    Build new requests with :meth:`new`; the constructor takes every field.
    """

    request_id: str
    tenant_id: str
    priority: Priority
    prompt: str
    model: str
    max_tokens: int
    created_at: int
    timeout_ms: int
    user_tier: str = "standard"
    task_tier: TaskTier = TaskTier.ASYNC
    allow_degrade: bool = False
    notify_queued: bool = False
    trace_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    # Revision 3: set by the gateway, never by clients. Last, as in the schema, so
    # positional construction with the earlier fields keeps working.
    admitted_at: int | None = None
    effective_priority: Priority | None = None
    degraded_from: str | None = None

    @classmethod
    def new(
        cls,
        tenant_id: str,
        prompt: str,
        *,
        priority: Priority | str = Priority.NORMAL,
        model: str = "sim-small",
        max_tokens: int = 256,
        timeout_ms: int = 60_000,
        **optional: Any,
    ) -> Request:
        """A fresh request with a random UUID4 ``request_id`` and ``created_at`` = now.

        ``optional`` takes any other field (``user_tier``, ``task_tier``,
        ``allow_degrade``, ``notify_queued``, ``trace_id``, ``metadata``, the
        gateway's ``admitted_at``/``effective_priority``/``degraded_from``, and also
        ``request_id``/``created_at`` to pin them). ``priority``, ``task_tier`` and
        ``effective_priority`` may be given as case-insensitive names.
        """
        if type(priority) is not Priority:
            priority = Priority.parse(priority)
        task_tier = optional.get("task_tier")
        if task_tier is not None and type(task_tier) is not TaskTier:
            optional["task_tier"] = TaskTier.parse(task_tier)
        effective = optional.get("effective_priority")
        if effective is not None and type(effective) is not Priority:
            optional["effective_priority"] = Priority.parse(effective)
        request_id = optional.pop("request_id", None) or str(uuid.uuid4())
        created_at = optional.pop("created_at", None)
        if created_at is None:
            created_at = now_ms()
        return cls(
            request_id=request_id,
            tenant_id=tenant_id,
            priority=priority,
            prompt=prompt,
            model=model,
            max_tokens=max_tokens,
            created_at=created_at,
            timeout_ms=timeout_ms,
            **optional,
        )

    @property
    def deadline_ms(self) -> int:
        """Epoch milliseconds after which the client no longer wants an answer."""
        return self.created_at + self.timeout_ms

    @property
    def serving_priority(self) -> Priority:
        """The band it is served in: the gateway's ``effective_priority``, else ``priority``."""
        return self.effective_priority or self.priority

    def to_record(self) -> dict[str, Any]:
        """The Avro record dict (enums as symbol strings; ``metadata`` is not copied)."""
        effective = self.effective_priority
        return {
            "request_id": self.request_id,
            "tenant_id": self.tenant_id,
            "priority": self.priority._value_,
            "prompt": self.prompt,
            "model": self.model,
            "max_tokens": self.max_tokens,
            "created_at": self.created_at,
            "timeout_ms": self.timeout_ms,
            "user_tier": self.user_tier,
            "task_tier": self.task_tier._value_,
            "allow_degrade": self.allow_degrade,
            "notify_queued": self.notify_queued,
            "trace_id": self.trace_id,
            "metadata": self.metadata,
            "admitted_at": self.admitted_at,
            "effective_priority": None if effective is None else effective._value_,
            "degraded_from": self.degraded_from,
        }

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Request:
        """Build from an Avro record dict; optional fields may be absent.

        Raises ``KeyError`` for a missing required field and ``ValueError`` for an
        unknown enum symbol.
        """
        value = rec["priority"]
        try:
            priority = _PRIORITY_BY_SYMBOL[value]
        except (KeyError, TypeError):
            raise _symbol_error(Priority, "priority", value) from None
        task_tier = rec.get("task_tier", "ASYNC")
        try:
            task_tier = _TASK_TIER_BY_SYMBOL[task_tier]
        except (KeyError, TypeError):
            raise _symbol_error(TaskTier, "task_tier", task_tier) from None
        effective = rec.get("effective_priority")
        if effective is not None:
            try:
                effective = _PRIORITY_BY_SYMBOL[effective]
            except (KeyError, TypeError):
                raise _symbol_error(Priority, "effective_priority", effective) from None
        return cls(
            rec["request_id"],
            rec["tenant_id"],
            priority,
            rec["prompt"],
            rec["model"],
            rec["max_tokens"],
            rec["created_at"],
            rec["timeout_ms"],
            rec.get("user_tier", "standard"),
            task_tier,
            rec.get("allow_degrade", False),
            rec.get("notify_queued", False),
            rec.get("trace_id"),
            rec.get("metadata") or {},
            rec.get("admitted_at"),
            effective,
            rec.get("degraded_from"),
        )


@dataclass(slots=True, kw_only=True)
class Response:
    """The answer to one request (Avro record ``io.llmq.v1.LLMResponse``).

    Either its terminal outcome or, when ``status`` is ``QUEUED``, a progress event
    (``queue_position``/``eta_ms``) sent before it; ``status.is_terminal`` tells which.
    Keyword-only, because the schema puts required fields (``requested_priority``,
    ``created_at``, ``finished_at``) after optional ones. Build one with
    :meth:`for_request`.
    """

    request_id: str
    tenant_id: str
    status: Status
    reason: str | None = None
    output: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str | None = None
    degraded: bool = False
    requested_priority: Priority
    served_priority: Priority | None = None
    created_at: int
    admitted_at: int | None = None
    started_at: int | None = None
    finished_at: int
    worker_id: str | None = None
    retry_after_ms: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    queue_position: int | None = None
    eta_ms: int | None = None

    @classmethod
    def for_request(cls, req: Request, status: Status | str, **fields: Any) -> Response:
        """A response to ``req``: copies its id, tenant, priority and ``created_at``.

        ``finished_at`` defaults to now; ``fields`` sets any other field.
        """
        if type(status) is not Status:
            status = Status.parse(status)
        if "finished_at" not in fields:
            fields["finished_at"] = now_ms()
        return cls(
            request_id=req.request_id,
            tenant_id=req.tenant_id,
            status=status,
            requested_priority=req.priority,
            created_at=req.created_at,
            **fields,
        )

    @property
    def latency_ms(self) -> int:
        """Milliseconds from the request's creation to this response."""
        return self.finished_at - self.created_at

    def to_record(self) -> dict[str, Any]:
        """The Avro record dict (enums as symbol strings; ``metadata`` is not copied)."""
        served = self.served_priority
        return {
            "request_id": self.request_id,
            "tenant_id": self.tenant_id,
            "status": self.status._value_,
            "reason": self.reason,
            "output": self.output,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "model": self.model,
            "degraded": self.degraded,
            "requested_priority": self.requested_priority._value_,
            "served_priority": None if served is None else served._value_,
            "created_at": self.created_at,
            "admitted_at": self.admitted_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "worker_id": self.worker_id,
            "retry_after_ms": self.retry_after_ms,
            "metadata": self.metadata,
            "queue_position": self.queue_position,
            "eta_ms": self.eta_ms,
        }

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Response:
        """Build from an Avro record dict; optional fields may be absent.

        Raises ``KeyError`` for a missing required field and ``ValueError`` for an
        unknown enum symbol.
        """
        value = rec["status"]
        try:
            status = _STATUS_BY_SYMBOL[value]
        except (KeyError, TypeError):
            raise _symbol_error(Status, "status", value) from None
        value = rec["requested_priority"]
        try:
            requested = _PRIORITY_BY_SYMBOL[value]
        except (KeyError, TypeError):
            raise _symbol_error(Priority, "requested_priority", value) from None
        served = rec.get("served_priority")
        if served is not None:
            try:
                served = _PRIORITY_BY_SYMBOL[served]
            except (KeyError, TypeError):
                raise _symbol_error(Priority, "served_priority", served) from None
        return cls(
            request_id=rec["request_id"],
            tenant_id=rec["tenant_id"],
            status=status,
            reason=rec.get("reason"),
            output=rec.get("output"),
            prompt_tokens=rec.get("prompt_tokens", 0),
            completion_tokens=rec.get("completion_tokens", 0),
            model=rec.get("model"),
            degraded=rec.get("degraded", False),
            requested_priority=requested,
            served_priority=served,
            created_at=rec["created_at"],
            admitted_at=rec.get("admitted_at"),
            started_at=rec.get("started_at"),
            finished_at=rec["finished_at"],
            worker_id=rec.get("worker_id"),
            retry_after_ms=rec.get("retry_after_ms"),
            metadata=rec.get("metadata") or {},
            queue_position=rec.get("queue_position"),
            eta_ms=rec.get("eta_ms"),
        )
