"""The band queues as the broker holds them: the dispatch topics' offsets.

Every gateway instance reads the same numbers, so queue caps, positions, ETAs and the load are
global however many gateways run. Per band: the end offsets of its dispatch partitions minus
what the workers committed there (``gateway.worker_groups``; a partition no worker committed
yet counts from its first offset). The sums of end and of committed
offsets are the arrival and drain totals (:meth:`pipeline.policy.queues.QueueModel.observe`).

The admin calls block, so they run on a thread of their own; each reading is handed to the event
loop.

The workers' commits are read with a consumer per worker group (``committed()``, never
subscribing), not the admin client's ListConsumerGroupOffsets: librdkafka aborts the process in
that coordinator request when the group's coordinator goes away mid-call (librdkafka#4605,
"rd_kafka_enq_once_del_source_return: Assertion `eonce->refcnt > 0' failed"; fix proposed in
confluentinc/librdkafka#5397), or crashes reading its NOT_COORDINATOR answer (librdkafka#5040).
On a replicated cluster that is every coordinator move: both gateways of the fault harness died
so when a partition leader was killed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from pipeline.config import Settings
from pipeline.models import BANDS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reading:
    depths: list[int]  # per band rank
    arrived: int  # sum of end offsets
    drained: int  # sum of committed offsets
    at_ms: float
    partitions: list[list[int]] | None = None  # per band rank, per dispatch partition
    arrivals: list[int] | None = None  # per band rank: sum of end offsets
    ends: list[list[int]] | None = None  # per band rank, per dispatch partition: end offsets


class DispatchDepths:
    """Reads the dispatch topics' depths every ``interval_s`` and calls ``deliver(reading)``."""

    def __init__(self, settings: Settings, deliver: Callable[[Reading], None], interval_s: float = 0.5,
                 timeout_s: float = 5.0):
        self.topics = {settings.topics.dispatch_topic(p): p.rank for p in BANDS}
        self.partitions = settings.topics.dispatch_partitions
        self.deliver = deliver
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.admin = AdminClient(settings.kafka.admin_config())
        self.groups = list(settings.gateway.worker_groups or settings.worker.group_ids())
        # Only OffsetFetch on the group's coordinator: these consumers never join their group.
        self.readers = {g: Consumer(settings.kafka.consumer_config(g, **{"client.id": "llmq-gateway-depths"}))
                        for g in self.groups}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmq-gateway-depths", daemon=True)
        self._warned = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # the thread closes its readers as it ends

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.deliver(self.read())
                self._warned = False
            except (KafkaException, OSError) as exc:
                if not self._warned:  # once per outage, not at every reading
                    log.warning("cannot read the dispatch topics' depths (%s); queue caps and ETAs use the last "
                                "reading until it works again", exc)
                    self._warned = True
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
        for reader in self.readers.values():
            reader.close()

    def read(self) -> Reading:
        tps = [TopicPartition(t, p) for t in self.topics for p in range(self.partitions)]
        ends = self._offsets(tps, OffsetSpec.latest())
        committed = self._committed()
        missing = [tp for tp in tps if (tp.topic, tp.partition) not in committed]
        starts = self._offsets(missing, OffsetSpec.earliest()) if missing else {}
        parts = [[0] * self.partitions for _ in BANDS]
        part_ends = [[0] * self.partitions for _ in BANDS]
        ends_by_band = [0] * len(BANDS)
        arrived = drained = 0
        for tp in tps:
            key = (tp.topic, tp.partition)
            end = ends.get(key, 0)
            done = committed.get(key, starts.get(key, 0))
            parts[self.topics[tp.topic]][tp.partition] = max(0, end - done)
            ends_by_band[self.topics[tp.topic]] += end
            part_ends[self.topics[tp.topic]][tp.partition] = end
            arrived += end
            drained += min(done, end)
        return Reading([sum(band) for band in parts], arrived, drained, time.time() * 1000.0, parts, ends_by_band,
                       part_ends)

    def _offsets(self, tps: list[TopicPartition], spec: OffsetSpec) -> dict[tuple[str, int], int]:
        futures = self.admin.list_offsets({tp: spec for tp in tps}, request_timeout=self.timeout_s)
        return {(tp.topic, tp.partition): fut.result().offset for tp, fut in futures.items()}

    def _committed(self) -> dict[tuple[str, int], int]:
        """The furthest commit of the worker groups on each dispatch partition (one pool reads a band)."""
        tps = [TopicPartition(t, p) for t in self.topics for p in range(self.partitions)]
        out: dict[tuple[str, int], int] = {}
        for reader in self.readers.values():
            for tp in reader.committed(tps, timeout=self.timeout_s):
                if tp.error is None and tp.offset >= 0:
                    key = (tp.topic, tp.partition)
                    out[key] = max(out.get(key, 0), tp.offset)
        return out
