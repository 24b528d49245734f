"""In-memory records of llmq: requests, responses, streamed chunks and their enums.

The dataclasses mirror the Avro schemas in ``schemas/`` field for field (same names,
same defaults). Timestamps stay plain ``int`` epoch milliseconds, exactly as they are
on the wire, and enums are ``str`` enums whose value is the Avro symbol, so converting
to and from the record dicts fastavro reads and writes is a handful of dict look-ups.

``to_record``/``from_record`` sit on the hot path (every message produced or
consumed), which is why they are written out field by field instead of going through
``dataclasses.asdict`` or ``**record``.

Chat messages (``Request.messages``, revision 4) are plain dicts in the OpenAI shape,
``{"role": ..., "content": ...}`` plus ``"name"`` only when it is set, so they go to a
model server's JSON body as they are.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

__all__ = [
    "BANDS",
    "CHAT_MESSAGE_KEYS",
    "Chunk",
    "LOWEST_RANK",
    "Priority",
    "Status",
    "TERMINAL_STATUSES",
    "TaskTier",
    "Request",
    "Response",
    "now_ms",
    "render_conversation",
]


#: Kafka header of a dispatched request the gateway shaped under a rate limit: epoch ms (ASCII)
#: before which no worker starts it.
NOT_BEFORE_HEADER = "llmq-not-before"

#: Kafka header of a request the gateway dispatched again: its value says why, REDELIVERED (the
#: gateway read its request record again after a failover) or RESUBMITTED (a client sent the id
#: again). A worker that did not take the first copy reads its answer back
#: (pipeline/worker/earlier_answers.py).
DISPATCHED_AGAIN_HEADER = "llmq-dispatched-again"
REDELIVERED = b"redelivered"
RESUBMITTED = b"resubmitted"


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


#: The keys a chat message may have (record ``io.llmq.v1.ChatMessage``).
CHAT_MESSAGE_KEYS = frozenset(("role", "content", "name"))


def _chat_message(message: Any, index: int) -> dict[str, Any]:
    """``message`` as a chat message dict (``name`` only when set); ``ValueError`` unless it
    is a mapping with ``role`` and ``content`` and no other keys than ``name``."""
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}]: a message is a mapping with role and content, "
                         f"got {type(message).__name__}")
    extra = message.keys() - CHAT_MESSAGE_KEYS
    if extra:
        # Refused rather than dropped: the schema has nowhere to keep them (tool_calls, ...).
        raise ValueError(f"messages[{index}]: unknown keys {sorted(map(str, extra))} "
                         "(a message has role, content and optionally name)")
    try:
        out = {"role": message["role"], "content": message["content"]}
    except KeyError as exc:
        raise ValueError(f"messages[{index}]: missing {exc.args[0]}") from None
    name = message.get("name")
    if name is not None:
        out["name"] = name
    return out


def _message_from_record(rec: Mapping[str, Any]) -> dict[str, Any]:
    name = rec.get("name")
    if name is None:
        return {"role": rec["role"], "content": rec["content"]}
    return {"role": rec["role"], "content": rec["content"], "name": name}


def render_conversation(messages: Any) -> str:
    """A conversation as plain text, one ``role: content`` line per message: the prompt of a
    request built from messages, for readers of revisions before 4, which know no messages."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


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
    # Revision 4: the OpenAI request shape, and where the answer goes.
    messages: list[dict[str, Any]] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    user: str | None = None
    stream: bool = False
    reply_to: str | None = None
    reply_partition: int | None = None

    @classmethod
    def new(
        cls,
        tenant_id: str,
        prompt: str | None = None,
        *,
        priority: Priority | str = Priority.NORMAL,
        model: str = "",
        max_tokens: int = 256,
        timeout_ms: int = 60_000,
        **optional: Any,
    ) -> Request:
        """A fresh request with a random UUID4 ``request_id`` and ``created_at`` = now.

        ``model`` "" runs on the default model: ``models.default``, else the first model the
        servers list (pipeline/catalog/); the answer names the model that ran.

        ``optional`` takes any other field (``user_tier``, ``task_tier``,
        ``allow_degrade``, ``notify_queued``, ``trace_id``, ``metadata``, the
        gateway's ``admitted_at``/``effective_priority``/``degraded_from``, revision
        4's ``messages``, ``temperature``, ``top_p``, ``stop``, ``user``, ``stream``,
        ``reply_to``, ``reply_partition``, and also ``request_id``/``created_at`` to pin
        them). ``priority``, ``task_tier`` and ``effective_priority`` may be given as
        case-insensitive names.

        ``messages`` are mappings with ``role``, ``content`` and optionally ``name``
        (``ValueError`` otherwise); without a ``prompt`` the prompt is
        :func:`render_conversation` of them, so a worker on an older revision can still
        serve the request. One of the two is needed. ``stop`` may be one string, as in
        OpenAI's API.
        """
        if type(priority) is not Priority:
            priority = Priority.parse(priority)
        task_tier = optional.get("task_tier")
        if task_tier is not None and type(task_tier) is not TaskTier:
            optional["task_tier"] = TaskTier.parse(task_tier)
        effective = optional.get("effective_priority")
        if effective is not None and type(effective) is not Priority:
            optional["effective_priority"] = Priority.parse(effective)
        messages = optional.get("messages")
        if messages:
            messages = optional["messages"] = [_chat_message(m, i) for i, m in enumerate(messages)]
        if prompt is None:
            if not messages:
                raise ValueError("Request.new needs a prompt or messages")
            prompt = render_conversation(messages)
        stop = optional.get("stop")
        if isinstance(stop, str):
            optional["stop"] = [stop]
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

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation to send a chat model: ``messages`` when set (copies), else the
        prompt as one user message."""
        if self.messages:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]

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
            "messages": self.messages,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": self.stop,
            "user": self.user,
            "stream": self.stream,
            "reply_to": self.reply_to,
            "reply_partition": self.reply_partition,
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
        messages = rec.get("messages")
        messages = [_message_from_record(m) for m in messages] if messages else []
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
            messages,
            rec.get("temperature"),
            rec.get("top_p"),
            rec.get("stop") or [],
            rec.get("user"),
            rec.get("stream", False),
            rec.get("reply_to"),
            rec.get("reply_partition"),
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
    # Revision 3.
    finish_reason: str | None = None
    usage_estimated: bool = False

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
            "finish_reason": self.finish_reason,
            "usage_estimated": self.usage_estimated,
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
            finish_reason=rec.get("finish_reason"),
            usage_estimated=rec.get("usage_estimated", False),
        )


@dataclass(slots=True, kw_only=True)
class Chunk:
    """A piece of a streamed answer (Avro record ``io.llmq.v1.LLMChunk``).

    A request's chunks have ``seq`` 0, 1, 2, ... without gaps; the last one has
    ``finish_reason`` set, and the terminal :class:`Response` (with the whole output)
    follows. Keyword-only for the same reason as :class:`Response`. Build one with
    :meth:`for_request`.
    """

    request_id: str
    tenant_id: str
    seq: int
    delta: str
    finish_reason: str | None = None
    emitted_at: int
    worker_id: str | None = None

    @classmethod
    def for_request(cls, req: Request, seq: int, delta: str, **fields: Any) -> Chunk:
        """Chunk ``seq`` of the answer to ``req``; ``emitted_at`` defaults to now, ``fields``
        sets ``finish_reason``/``worker_id``."""
        if "emitted_at" not in fields:
            fields["emitted_at"] = now_ms()
        return cls(request_id=req.request_id, tenant_id=req.tenant_id, seq=seq, delta=delta, **fields)

    @property
    def last(self) -> bool:
        """Whether this chunk ends its stream (it says why: ``finish_reason``)."""
        return self.finish_reason is not None

    def to_record(self) -> dict[str, Any]:
        """The Avro record dict."""
        return {
            "request_id": self.request_id,
            "tenant_id": self.tenant_id,
            "seq": self.seq,
            "delta": self.delta,
            "finish_reason": self.finish_reason,
            "emitted_at": self.emitted_at,
            "worker_id": self.worker_id,
        }

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Chunk:
        """Build from an Avro record dict; ``KeyError`` for a missing required field."""
        return cls(
            request_id=rec["request_id"],
            tenant_id=rec["tenant_id"],
            seq=rec["seq"],
            delta=rec["delta"],
            finish_reason=rec.get("finish_reason"),
            emitted_at=rec["emitted_at"],
            worker_id=rec.get("worker_id"),
        )
