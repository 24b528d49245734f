"""Where each request partition must be read from after a rebalance, so that no request is skipped.

faust-streaming delivers, after a rebalance that gives a gateway back a partition it already
had, what is left of a batch fetched before it (faust-streaming/faust#221, the same report as
#216): records *past* the committed offset, before the ones at it. Faust then counts the
offsets in between as a gap in the topic (acknowledged, never delivered) and drops the
refetched records below the stale one's offset, so its next commit moves past requests nobody
decided. Seen here: three gateways, one SIGKILLed, 18 requests of one partition never answered.

The guard, through Faust's public consumer API: at assignment, each request partition's next
offset is the group's committed one (or the log start); until the first record at that offset
arrives, a record past it is not handled and the partition is sought back (``Consumer.seek``),
which makes Faust read from there again. A second jump to the same record is a real hole in the
log (a transaction marker) and is taken. What remains of the upstream bug: Faust has already
counted the skipped offsets as acknowledged, and commits past them as soon as the first of
them is handled again, so a gateway killed in the second or so that re-reading takes would
skip them still. The completions agent is not guarded: its topics are written in
transactions, and a record it misses costs a quota slot until the sweep, not an answer.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

log = logging.getLogger(__name__)

#: (topic, partition)
TP = tuple[str, int]


class ReadPositions:
    """Per request partition: the offset the first record after an assignment must have."""

    def __init__(self, start_offsets: Callable[[list[TP]], dict[TP, int]]):
        #: Where the group left each partition (its committed offset, else the log start).
        self.start_offsets = start_offsets
        self._next: dict[TP, int] = {}  # armed partitions only: the offset expected first
        self._jump: dict[TP, int] = {}  # the last record seen past it
        self.sought = 0  # seeks made (a stale batch after a rebalance), for the log and the tests

    def assigned(self, partitions: Iterable[TP]) -> None:
        tps = list(partitions)
        self._next = {tp: off for tp, off in self.start_offsets(tps).items() if off is not None and off >= 0}
        self._jump = {}

    def check(self, tp: TP, offset: int) -> int | None:
        """None: handle the record. An offset: do not handle it; seek ``tp`` there first."""
        expected = self._next.get(tp)
        if expected is None:
            return None
        if offset == expected or self._jump.get(tp) == offset:
            # The first record where the group left off (or past a real hole): read in order from here.
            del self._next[tp]
            self._jump.pop(tp, None)
            return None
        if offset < expected:
            return None  # below the commit: already decided, the intake answers it again
        self._jump[tp] = offset
        self.sought += 1
        log.info("%s[%d]: record %d came before %d, where the group left off (faust-streaming#221): "
                 "reading again from %d", tp[0], tp[1], offset, expected, expected)
        return expected


def committed_or_start(settings, group: str) -> Callable[[list[TP]], dict[TP, int]]:
    """Committed offsets of ``group`` (the log start where it has none), read with librdkafka."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = None  # made at the first assignment: it never joins the group, only reads its offsets

    def read(tps: list[TP]) -> dict[TP, int]:
        nonlocal consumer
        if not tps:
            return {}
        if consumer is None:
            consumer = Consumer(settings.kafka.consumer_config(group, **{"enable.auto.commit": False}))
        out: dict[TP, int] = {}
        for tp in consumer.committed([TopicPartition(t, p) for t, p in tps], timeout=10):
            offset = tp.offset
            if offset < 0:
                offset = consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=10)[0]
            out[(tp.topic, tp.partition)] = offset
        return out

    return read
