"""What the worker's parts share: its counters, and the current session's clients and end.

A worker runs one session after another (a restart after an aborted transaction makes fresh
clients), and a producer stuck in a transactional call is abandoned mid-session. So no part
keeps its own reference to a client: each looks it up in :class:`Session` at every use.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pipeline.errors import KafkaOperationError


@dataclass
class WorkerStats:
    consumed: int = 0
    completed: int = 0
    failed: int = 0
    expired: int = 0
    rejected: int = 0
    cancelled: int = 0
    dead_lettered: int = 0
    delivery_retries: int = 0
    commits: int = 0
    skipped_done: int = 0  # redelivered messages already answered (listed in commit metadata)
    duplicates: int = 0  # re-seen request ids: dropped while the first ran, else answered the same again
    rebalances: int = 0
    preempted: int = 0  # backend calls cancelled for a higher band's request (run again later)
    preempted_in_band: int = 0  # of those, calls of a tenant crowding its band (worker.fair_preemption)
    delivered: int = 0  # responses and dead letters the broker acknowledged (exactly-once: committed)
    first_consumed_at: float = 0.0  # time.perf_counter() of the first message
    last_delivered_at: float = 0.0


class Session:
    """The clients of the session running now, and whether it must end early."""

    __slots__ = ("consumer", "producer", "chunk_producer", "cancellations", "fatal", "restart", "turned_at",
                 "held_until")

    def __init__(self) -> None:
        self.consumer = None
        self.producer = None  # None once abandoned (see checkpoint.py): nothing can be produced then
        #: Exactly-once only: streamed chunks go out outside the transactions (see streaming.py).
        self.chunk_producer = None
        self.cancellations = None
        #: The error that stops the worker (the first one reported).
        self.fatal: KafkaOperationError | None = None
        #: Start over from the committed offsets with fresh clients: the consumer does not rewind
        #: by itself after an aborted transaction.
        self.restart = False
        #: When the consume loop last turned (time.monotonic(); 0: not yet), and until when it
        #: holds new work after standing still past the group session (see loop.py).
        self.turned_at = 0.0
        self.held_until = 0.0

    def in_doubt(self, now: float, session_s: float) -> bool:
        """Whether the group may have given this worker's partitions away without its knowing
        yet: its loop has stood still past the session (a freeze it has not noticed), or holds
        work since it noticed one. An answer finished meanwhile could follow the next owner's
        answer to the same record, and differ from it."""
        return now < self.held_until or (self.turned_at > 0 and now - self.turned_at > session_s)

    def fail(self, error: KafkaOperationError) -> None:
        if self.fatal is None:
            self.fatal = error

    @property
    def over(self) -> bool:
        return self.fatal is not None or self.restart


#: How often an answer waiting out a doubt (Session.in_doubt) looks again.
_DOUBT_POLL_S = 0.05


async def out_of_doubt(session: Session, session_s: float) -> None:
    """Return once ``session`` is not in doubt; an answer whose partition was lost meanwhile is
    handed back (its task cancelled) before then, and never goes out."""
    while session.in_doubt(time.monotonic(), session_s):
        await asyncio.sleep(_DOUBT_POLL_S)
