"""A producer that replaces its librdkafka client when it stops delivering.

Seen in `make chaos` on a three-node cluster (RF 3, min.insync.replicas 2): after the whole
cluster restarted, the first node up leads every partition with itself alone in sync, so writes
are refused (NOT_ENOUGH_REPLICAS) for a while. Long-lived idempotent producers that had records
in flight then delivered nothing more, for minutes, while the cluster was whole again and a new
producer in the same process delivered at once: `llmq serve` answered every request 503
`kafka_unavailable`, and the SDK's submits timed out. The same is reported against librdkafka
through confluent-kafka-dotnet#2519 ("Idempotent producer doesn't recover after partition
temporary unwritable"; open, only a restart recovers).

:class:`RenewingProducer` notes when each outstanding record was produced. When one has been
outstanding for ``stall_s`` (however many others were delivered meanwhile), it starts a new
librdkafka producer for what comes next and keeps polling the old one, whose records are
delivered late or fail with their own timeout (their callers see the failure; nothing is
dropped silently). At most one renewal per ``stall_s``, so a cluster that is really down for
long costs a few clients, not one per poll.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from confluent_kafka import Producer

log = logging.getLogger(__name__)

#: Retired producers kept (polled until empty); past this the oldest is flushed for no time and dropped.
MAX_RETIRED = 3


class _Watched:
    """One librdkafka producer and what it owes: when each outstanding record was produced."""

    __slots__ = ("producer", "sent", "next")

    def __init__(self, producer):
        self.producer = producer
        self.sent: dict[int, float] = {}  # record number → produced at, oldest first
        self.next = 0

    @property
    def outstanding(self) -> int:
        return len(self.sent)


class RenewingProducer:
    """The part of confluent-kafka's ``Producer`` a client uses: ``produce``, ``poll``, ``flush``,
    ``len``. Thread-safe as the ``Producer`` is: ``produce`` from any thread, ``poll`` from one."""

    def __init__(self, config: dict[str, Any], stall_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 factory: Callable[[dict], Any] = Producer):
        self.config = config
        self.stall_s = stall_s
        self.clock = clock
        self.factory = factory
        self._current = _Watched(factory(config))
        self._retired: list[_Watched] = []
        self.renewals = 0
        self._lock = threading.Lock()
        self._renewed_at = -float("inf")

    @property
    def current(self):
        return self._current.producer

    # -- the Producer's surface -------------------------------------------------------------

    def produce(self, topic: str, value=None, key=None, *, on_delivery=None, **kwargs) -> None:
        watched = self._current
        with self._lock:
            number = watched.next
            watched.next += 1

        def delivered(err, msg):
            with self._lock:
                watched.sent.pop(number, None)
            if on_delivery is not None:
                on_delivery(err, msg)

        with self._lock:  # before produce: the poll thread may report it delivered at once
            watched.sent[number] = self.clock()
        try:
            watched.producer.produce(topic, value, key, on_delivery=delivered, **kwargs)
        except BaseException:
            with self._lock:
                watched.sent.pop(number, None)
            raise

    def poll(self, timeout: float = 0.0) -> int:
        served = self._current.producer.poll(timeout)
        for old in list(self._retired):
            served += old.producer.poll(0)
            if len(old.producer) == 0:
                self._retired.remove(old)
        if self.stall_s:
            self._maybe_renew()
        return served

    def flush(self, timeout: float = -1) -> int:
        deadline = None if timeout is None or timeout < 0 else self.clock() + timeout
        left = 0
        for w in [*self._retired, self._current]:
            left += w.producer.flush(-1 if deadline is None else max(0.0, deadline - self.clock()))
        self._retired = [w for w in self._retired if len(w.producer)]
        return left

    def __len__(self) -> int:
        return len(self._current.producer) + sum(len(w.producer) for w in self._retired)

    # -- renewal ----------------------------------------------------------------------------

    def stalled_for(self) -> float | None:
        """How long the current producer's oldest outstanding record has waited. Per record, not
        since the last delivery: a client stuck on some partitions still delivers to others (a
        cancellation, a record of another topic)."""
        with self._lock:
            sent = self._current.sent
            if not sent:
                return None
            return self.clock() - next(iter(sent.values()))

    def _maybe_renew(self) -> None:
        stalled = self.stalled_for()
        now = self.clock()
        if stalled is None or stalled < self.stall_s or now - self._renewed_at < self.stall_s:
            return
        log.warning("Kafka producer delivered nothing for %.0f s with %d records outstanding; continuing on a new "
                    "producer (the old one's records are delivered late or fail on their own timeout)",
                    stalled, self._current.outstanding)
        self._retired.append(self._current)
        if len(self._retired) > MAX_RETIRED:
            self._retired.pop(0).producer.flush(0)
        self._current = _Watched(self.factory(self.config))
        self.renewals += 1
        self._renewed_at = now
