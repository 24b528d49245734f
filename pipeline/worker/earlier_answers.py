"""A copy of a request another worker answered: that first answer, read back from its topic.

A worker's memory of the ids it answered (dedupe.py) is its own. A gateway dispatches an id
again after a failover or a client's re-submission, marking the copy (``DISPATCHED_AGAIN_HEADER``),
and that copy lands in the same dispatch partition as the first. When the partition changed
owner in between, the worker taking the copy never saw the first, yet the first is answered
already: its previous owner committed past it only once the answer was durable. Running the
model again would give the id a second, different answer (a model need not answer the same
prompt the same way twice), so the copy's worker reads the first answer back from where the
copy's own answer would go, from the first admission on, and gives it again byte for byte.
Nothing found (the first copy never went out, or the answer is older than what the topic
keeps): the copy runs as a new request.

The same holds for a record the partition's previous owner may have answered without committing
it (killed, or frozen past its session, between answering and committing): its next owner takes
it again with no memory of the id. Running it again gives a second COMPLETED answer, the same
status; but answering it EXPIRED (its deadline passed meanwhile) or CANCELLED (a cancellation
came meanwhile: serve withdraws a request whose write timed out) would give the id a second,
*different* status. So before a worker answers EXPIRED or CANCELLED a record that may have been
answered (:func:`may_be_answered`: a copy dispatched again, or a record written before its
partition was assigned here), it reads the first answer back, and gives it again if there is
one. Such reads must say yes or no: they skip the cool-down below and are tried again while the
broker cannot answer; and since a rebalance can leave many such records expiring at once, the
ones waiting for the same partition are read back together, in one pass
(:meth:`EarlierAnswers.find_many`). They cost nothing in steady state: only records expiring or cancelled
soon after a rebalance (or copies dispatched again) are looked up.

One consumer, assigned per lookup, never in a group; lookups run one at a time off the event
loop (they are rare: a copy reaching a worker that did not take the first).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from pipeline.config import Settings
from pipeline.errors import DecodeError
from pipeline.models import DISPATCHED_AGAIN_HEADER, REDELIVERED
from pipeline.partitioning import ANY_PARTITION, tenant_partition

log = logging.getLogger(__name__)

#: Read back from this long before the first admission: the answer's timestamp is the worker's
#: clock, the admission the gateway's, and hosts' clocks differ a little.
CLOCK_SKEW_MS = 10_000
#: How long one lookup may read before the copy runs as new instead.
LOOKUP_TIMEOUT_S = 10.0
#: After a lookup the broker could not answer (a leader down), how long copies run as new without
#: one: lookups go one at a time, and each would wait out its timeout again.
COOL_DOWN_S = 10.0
#: What :meth:`EarlierAnswers.find_many` returns when the broker could not be read: neither found
#: nor known to be absent.
UNREADABLE = "unreadable"
#: A timestamp type that says the record has none (confluent_kafka.TIMESTAMP_NOT_AVAILABLE).
_NO_TIMESTAMP = 0


def dispatched_again(headers: list | None) -> bytes | None:
    """Why the gateway dispatched this record's id again (REDELIVERED, RESUBMITTED), or None for
    its first dispatch."""
    if headers:
        for name, value in headers:
            if name == DISPATCHED_AGAIN_HEADER:
                return value or b""
    return None


def redelivered(headers: list | None) -> bool:
    """Whether the gateway dispatched this id again because it read its request record again
    (a failover), not because a client asked again."""
    return dispatched_again(headers) == REDELIVERED


def may_be_answered(headers: list | None, timestamp: tuple[int, int] | None, assigned_at_ms: int | None) -> bool:
    """Whether a record (its ``headers`` and ``timestamp`` as ``Message.timestamp()`` gives it)
    may have been answered already by a worker other than this one: the gateway dispatched its id
    again, or it was written before its partition was assigned here (``assigned_at_ms``, less the
    clock skew between the gateway's host and this one; None: no previous owner to ask about,
    as for a worker driven without a broker, or exactly-once, where an answer is visible only with
    its committed offset), so that the partition's previous owner may have taken it."""
    if dispatched_again(headers) is not None:
        return True
    if assigned_at_ms is None:
        return False
    if timestamp is None or timestamp[0] == _NO_TIMESTAMP or timestamp[1] < 0:
        return True
    return timestamp[1] < assigned_at_ms + CLOCK_SKEW_MS


def first_terminal(records: Iterable, request_id: str, decode: Callable) -> tuple[bytes, bytes] | None:
    """The first terminal answer to ``request_id`` among ``records`` (``(value, key)`` pairs, in
    offset order) as its ``(value, key)``; progress events and other ids are passed over. Only a
    value that contains the id's bytes is decoded."""
    found: dict = {}
    first_terminals(records, {request_id}, decode, found)
    return found.get(request_id)


def first_terminals(records: Iterable, ids: set[str], decode: Callable, found: dict) -> None:
    """:func:`first_terminal` for each of ``ids`` at once: ``found`` gets the first terminal answer
    of each id among ``records`` it does not hold yet (an id answered in an earlier batch of
    records keeps that answer). One search over each value for all the ids' bytes."""
    wanted = ids - found.keys()
    if not wanted:
        return
    needles = re.compile(b"|".join(re.escape(i.encode()) for i in sorted(wanted)))
    for value, key in records:
        if not value or needles.search(value) is None:
            continue
        try:
            response = decode(value)
        except DecodeError:
            continue
        rid = response.request_id
        if rid in wanted and response.status.is_terminal:
            found[rid] = (value, key)
            wanted.discard(rid)
            if not wanted:
                return


class EarlierAnswers:
    def __init__(self, settings: Settings, worker_id: str, decode: Callable,
                 partitions: Callable[[str], int | None], max_records: int):
        """``partitions(topic)``: its partition count (None if unknown); ``max_records``: the
        most records one lookup reads (0: no lookups, a copy runs as new)."""
        self.settings = settings
        self.worker_id = worker_id
        self.decode = decode
        self.partitions = partitions
        self.max_records = max_records
        self._consumer: Consumer | None = None
        self._lock = threading.Lock()
        self.found = self.missed = 0
        self._failed_at = -COOL_DOWN_S

    @property
    def enabled(self) -> bool:
        return self.max_records > 0

    def place(self, topic: str, partition: int | None, key: bytes) -> int | None:
        """The partition an answer to ``topic``/``partition`` (ANY_PARTITION: the key's) went to,
        None if the topic's partitions are unknown. On the loop's thread: it may look them up."""
        if partition is not ANY_PARTITION:
            return partition
        count = self.partitions(topic)
        return tenant_partition(key, count) if count else None

    def find(self, topic: str, partition: int, request_id: str, since_ms: int) -> tuple[bytes, bytes] | None:
        """The first terminal answer to ``request_id`` in ``topic``[``partition``] at or after
        ``since_ms`` (less the clock skew), or None. Blocking: run it off the event loop. A Kafka
        error is a miss: the copy then runs as new, as it would have."""
        with self._lock:
            if time.monotonic() - self._failed_at < COOL_DOWN_S:
                answer = None  # the broker could not answer the last one: no waiting it out again
            else:
                try:
                    answer = self._scan(topic, partition, {request_id},
                                        max(0, since_ms - CLOCK_SKEW_MS)).get(request_id)
                except KafkaException as exc:
                    self._failed_at = time.monotonic()
                    log.warning("could not read back %s[%d] for the first answer to a copy (%s); running it, "
                                "and the copies of the next %.0f s without looking", topic, partition,
                                exc.args[0], COOL_DOWN_S)
                    answer = None
        if answer is None:
            self.missed += 1
        else:
            self.found += 1
        return answer

    def find_many(self, topic: str, partition: int, wanted: dict[str, int]) -> dict | str:
        """The first terminal answers in ``topic``[``partition``] to the ids of ``wanted`` (id →
        its first admission, ms), read in one pass from the earliest admission: id → its
        ``(value, key)``, for the ids found. Its answer decides a status, so: no cool-down, and
        :data:`UNREADABLE` when the broker could not be read. Blocking: off the event loop."""
        with self._lock:
            try:
                found = self._scan(topic, partition, set(wanted), max(0, min(wanted.values()) - CLOCK_SKEW_MS))
            except KafkaException as exc:
                self._failed_at = time.monotonic()
                log.warning("could not read back %s[%d] for the first answers to %d records (%s); asking again "
                            "before answering them", topic, partition, len(wanted), exc.args[0])
                return UNREADABLE
        self.found += len(found)
        self.missed += len(wanted) - len(found)
        return found

    def _scan(self, topic: str, partition: int, ids: set[str], since_ms: int) -> dict:
        """id → the first terminal answer to it, for the ``ids`` found (all of them stop the read)."""
        found: dict = {}
        consumer = self._client()
        deadline = time.monotonic() + LOOKUP_TIMEOUT_S
        start = consumer.offsets_for_times([TopicPartition(topic, partition, since_ms)], LOOKUP_TIMEOUT_S)[0]
        if start.error is not None or start.offset < 0:
            return found  # nothing written since the first admission
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), LOOKUP_TIMEOUT_S)
        consumer.assign([TopicPartition(topic, partition, start.offset)])
        try:
            read = 0
            while read < self.max_records and time.monotonic() < deadline:
                records, end = [], False
                for msg in consumer.consume(1000, 0.5):
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            end = True
                        continue
                    records.append((msg.value(), msg.key()))
                    end = end or msg.offset() >= high - 1
                read += len(records)
                first_terminals(records, ids, self.decode, found)
                if len(found) == len(ids) or end:
                    return found
            log.warning("gave up reading back %s[%d] for the first answers to %d records after reading %d; "
                        "taking them as not answered", topic, partition, len(ids), read)
            return found
        finally:
            consumer.unassign()

    def _client(self) -> Consumer:
        if self._consumer is None:
            # Assigned, never subscribed: the group id is only a name, nothing is committed.
            self._consumer = Consumer(self.settings.kafka.consumer_config(
                f"llmq-lookup-{self.worker_id}", **{"isolation.level": "read_committed",
                                                    "enable.partition.eof": True,
                                                    "client.id": f"llmq-worker-{self.worker_id}-lookup"}))
        return self._consumer

    def close(self) -> None:
        with self._lock:
            if self._consumer is not None:
                try:
                    self._consumer.close()
                except (KafkaException, RuntimeError):
                    pass
                self._consumer = None
