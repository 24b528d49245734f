"""No request record skipped after a rebalance: where each request partition must be read from,
and the records to read ourselves when Faust jumps past them.

faust-streaming can deliver, after a rebalance that gives a gateway back a partition it already
had, what is left of a batch fetched before it (faust-streaming/faust#221, the same report as
#216): a record *past* the committed offset comes first. Faust then counts the offsets in between
as a gap (acknowledged, never delivered), and drops the refetched records below the stale one's
offset, since it has "read" past them, so its next commit moves past requests nobody decided.
Seen here with three gateways, one SIGKILLed: requests of one partition were never answered.

Seeking back does not help: Faust's drain loop runs ahead of the agent, and every record it
delivers after the seek resets its read offset past the hole again. So the guard reads the hole
itself. At assignment (synchronously, before any record of the new generation is delivered),
each request partition's expected first offset is the group's committed one, or the log start.
The first record at or past it disarms the partition; if it is past it, the records in between
are read with a plain librdkafka consumer (:class:`HoleReader`, no group) and decided, in order,
before the record that jumped, as part of its event. Records below it were decided before and are
answered again by the intake, as any redelivery is. What remains of the upstream bug: Faust has
counted the hole acknowledged already, so a gateway killed between the jump and the write of the
hole's decisions (at the next checkpoint round) would skip them still. The completions agent is
not guarded: its topics are written in transactions, and a record it misses costs a quota slot
until the sweep, not an answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple

log = logging.getLogger(__name__)


class RequestPartition(NamedTuple):
    """One partition of a request topic."""

    topic: str
    partition: int


class Hole(NamedTuple):
    """The offsets Faust jumped past in one partition: ``first`` (where the group left off) up to
    ``end``, the record that came first, not included."""

    first: int
    end: int


@dataclass(frozen=True)
class Record:
    """A request record read outside Faust, with the fields the intake reads of a Faust message."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: float | None  # seconds, as Faust gives it
    headers: list = field(default_factory=list)


class ReadPositions:
    """Per request partition: the offset the first record after an assignment must have."""

    def __init__(self, start_offsets: Callable[[list[RequestPartition]], dict[RequestPartition, int]]):
        #: Where the group left each partition (its committed offset, else the log start).
        self.start_offsets = start_offsets
        self._next: dict[RequestPartition, int] = {}  # armed partitions only: the offset expected first
        self.holes = 0  # holes found (a stale batch after a rebalance), for the log and the tests

    def assigned(self, partitions: Iterable[RequestPartition]) -> None:
        tps = list(partitions)
        try:
            starts = self.start_offsets(tps)
        except Exception as exc:  # noqa: BLE001 (the broker unreachable now: unguarded, as Faust is alone)
            log.warning("cannot read the committed offsets of %d request partitions (%s): a stale batch after "
                        "this rebalance would go unnoticed (faust-streaming#221)", len(tps), exc)
            starts = {}
        self._next = {tp: off for tp, off in starts.items() if off is not None and off >= 0}

    def check(self, tp: RequestPartition, offset: int) -> Hole | None:
        """None: handle the record. A :class:`Hole`: first read and decide the offsets in it."""
        expected = self._next.get(tp)
        if expected is None or offset < expected:
            return None  # unguarded, or below the commit: already decided, the intake answers it again
        del self._next[tp]
        if offset == expected:
            return None  # where the group left off: in order from here
        self.holes += 1
        topic, partition = tp
        log.info("%s[%d]: record %d came before %d, where the group left off (faust-streaming#221): "
                 "reading %d records in between first", topic, partition, offset, expected, offset - expected)
        return Hole(expected, offset)


class HoleReader:
    """Reads the records of a :class:`Hole` with librdkafka, outside the group."""

    def __init__(self, settings, timeout_s: float = 30.0):
        self.settings = settings
        self.timeout_s = timeout_s

    def read(self, tp: RequestPartition, hole: Hole) -> list[Record]:
        import time

        from confluent_kafka import Consumer, KafkaError, TopicPartition

        topic, partition, lo, hi = tp.topic, tp.partition, hole.first, hole.end
        consumer = Consumer(self.settings.kafka.consumer_config(
            "llmq-gateway-holes", **{"enable.auto.commit": False, "enable.partition.eof": True}))
        out: list[Record] = []
        try:
            consumer.assign([TopicPartition(topic, partition, lo)])
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                msg = consumer.poll(0.5)
                if msg is not None and not msg.error() and msg.offset() < hi:
                    ts = msg.timestamp()[1]
                    out.append(Record(topic, partition, msg.offset(), msg.key(), msg.value(),
                                      ts / 1000.0 if ts and ts > 0 else None, list(msg.headers() or ())))
                # Done at hi, or at the log end: transaction markers have no record.
                position = consumer.position([TopicPartition(topic, partition)])[0].offset
                at_end = msg is not None and msg.error() is not None and msg.error().code() == KafkaError._PARTITION_EOF
                if position >= hi or at_end:
                    return out
            log.error("%s[%d]: read %d of the records %d..%d in %.0f s; the rest are left to a redelivery",
                      topic, partition, len(out), lo, hi - 1, self.timeout_s)
            return out
        finally:
            consumer.close()


def committed_or_start(settings, group: str) -> Callable[[list[RequestPartition]], dict[RequestPartition, int]]:
    """Committed offsets of ``group`` (the log start where it has none), read with librdkafka."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    consumer = None  # made at the first assignment: it never joins the group, only reads its offsets

    def read(tps: list[RequestPartition]) -> dict[RequestPartition, int]:
        nonlocal consumer
        if not tps:
            return {}
        if consumer is None:
            # read_uncommitted: librdkafka then asks for the committed offsets without waiting for
            # stable ones. Waiting, it blocked this assignment for its whole timeout after an
            # exactly-once gateway was killed (its open transaction's offsets pending until a new
            # producer fences it, which comes after the assignment): past the 3-s session, the
            # member was dropped and rebalanced again and again, and requests were dispatched twice.
            # Faust's own fetch at assignment reads the same unstable offsets (aiokafka: KIP-447).
            consumer = Consumer(settings.kafka.consumer_config(group, **{"enable.auto.commit": False,
                                                                         "isolation.level": "read_uncommitted"}))
        out: dict[RequestPartition, int] = {}
        missing = []
        for tp in consumer.committed([TopicPartition(t, p) for t, p in tps], timeout=10):
            if tp.offset >= 0:
                out[RequestPartition(tp.topic, tp.partition)] = tp.offset
            else:
                missing.append(tp)
        # A partition without a commit starts at its log start. One whose leader is unknown now
        # (a broker down) stays unguarded; the others keep their guard.
        for tp in missing:
            try:
                start = consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=5)[0]
            except KafkaException as exc:
                log.warning("%s[%d]: no committed offset and its log start unknown (%s): unguarded after this "
                            "rebalance (faust-streaming#221)", tp.topic, tp.partition, exc)
                continue
            out[RequestPartition(tp.topic, tp.partition)] = start
        return out

    return read


def committed_of_partition(settings, group: str, topics: list[str]) -> Callable[[int], dict[str, int]]:
    """``read(p)``: ``group``'s committed offset of partition ``p`` of each of ``topics`` (those it
    has one for), read with librdkafka, read_committed: stable offsets only (KIP-447)."""
    from confluent_kafka import Consumer, TopicPartition

    def read(partition: int) -> dict[str, int]:
        consumer = Consumer(settings.kafka.consumer_config(group, **{"enable.auto.commit": False,
                                                                     "isolation.level": "read_committed"}))
        try:
            got = consumer.committed([TopicPartition(t, partition) for t in topics], timeout=10)
        finally:
            consumer.close()
        return {tp.topic: tp.offset for tp in got if tp.offset >= 0}

    return read
