"""Consumer lag of llmq's groups: read with the admin API, exported under kafka_exporter's names.

One refresh = one set of admin round trips: list groups, describe them, their committed
offsets (one request per group: librdkafka's API takes one group per call), the cluster
metadata (brokers, partitions of every topic involved), the log-end and the oldest offsets
of those partitions (one batched ListOffsets each), and for partitions that lag, the
timestamp of the oldest unconsumed message (one fetch). A background thread refreshes
every ``interval``; scrapes only read the cached snapshot, so the broker sees the same load
whatever the scrape rate, and a scrape answers in milliseconds.

kafka_exporter's series, same names and labels (Grafana dashboard 7589, Strimzi's rules):
``kafka_brokers``, ``kafka_topic_partitions{topic}``,
``kafka_topic_partition_current_offset`` and ``kafka_topic_partition_oldest_offset``
``{topic,partition}``, ``kafka_consumergroup_current_offset``/``_lag``
``{consumergroup,topic,partition}``, ``kafka_consumergroup_current_offset_sum``/``_lag_sum``
``{consumergroup,topic}``, ``kafka_consumergroup_members{consumergroup}``. The topics are
those of the groups plus the pipeline's own (requests, dispatch, responses, dead letters,
cancellations), so "messages produced" covers every one of them.

Differences from kafka_exporter, on purpose: lag is clamped at ≥ 0 (end offsets are read
*after* committed offsets, so a commit racing the read cannot make it negative) and counts
only messages still in the log (from the oldest offset on, when retention deleted what a
group had not read); a partition with data but no committed offset has no
``current_offset`` series and is counted in ``llmq_consumergroup_uncommitted_partitions``
instead of reporting -1 (its lag is all of its data); groups without members keep
reporting; time lag is exact, from message timestamps, not interpolated.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pipeline.config import Settings
from pipeline.errors import KafkaOperationError
from pipeline.models import Priority

log = logging.getLogger(__name__)


@dataclass
class PartitionLag:
    group: str
    topic: str
    partition: int
    committed: int | None  # None: the group never committed here
    end: int
    lag: int
    oldest_timestamp_ms: int | None = None  # timestamp of the first unconsumed message

    def time_lag_s(self, now_ms: int) -> float:
        if self.lag == 0 or self.oldest_timestamp_ms is None:
            return 0.0
        return max(0.0, (now_ms - self.oldest_timestamp_ms) / 1000.0)


@dataclass
class GroupInfo:
    name: str
    state: str
    members: int
    #: topic → number of members assigned at least one of its partitions
    topic_members: dict[str, int] = field(default_factory=dict)


@dataclass
class LagSnapshot:
    taken_at_ms: int
    duration_s: float
    groups: dict[str, GroupInfo]
    partitions: list[PartitionLag]
    end_offsets: dict[tuple[str, int], int]
    oldest_offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    #: partitions per exported topic, and brokers, from the cluster metadata
    topic_partitions: dict[str, int] = field(default_factory=dict)
    brokers: int = 0

    def by_band(self, settings: Settings) -> dict[Priority, dict]:
        """Per priority: unconsumed requests, oldest age, consumers (max over llmq's groups)."""
        out = {}
        for band in Priority:
            topics = band_topics(settings, band)
            per_group: dict[str, int] = {}
            oldest = 0.0
            for p in self.partitions:
                if p.topic in topics:
                    per_group[p.group] = per_group.get(p.group, 0) + p.lag
                    oldest = max(oldest, p.time_lag_s(self.taken_at_ms))
            consumers = sum(g.topic_members.get(t, 0) for g in self.groups.values() for t in topics)
            out[band] = {"depth": max(per_group.values(), default=0), "oldest_age_s": oldest,
                         "consumers": consumers}
        return out


_LEADER_MOVING = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                  KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.REQUEST_TIMED_OUT, KafkaError._TIMED_OUT}


def _leader_moving(err) -> bool:
    return err.code() in _LEADER_MOVING or err.retriable()


def band_topics(settings: Settings, band: Priority) -> set[str]:
    # Dispatch topics arrive with the gateway; counting them now keeps dashboards stable.
    return {settings.topics.request_topic(band), f"{settings.topics.prefix}.dispatch.{band.value.lower()}"}


class LagReader:
    def __init__(self, settings: Settings, group_pattern: str = r"^llmq-", time_lag: bool = True,
                 request_timeout: float = 10.0):
        self.settings = settings
        self.pattern = re.compile(group_pattern)
        self.time_lag = time_lag
        self.request_timeout = request_timeout
        self.admin = AdminClient(settings.kafka.admin_config())
        self.round_trips = 0  # admin/fetch requests issued (tests check the cache holds this down)

    def _groups(self) -> list[str]:
        self.round_trips += 1
        result = self.admin.list_consumer_groups(request_timeout=self.request_timeout).result()
        return sorted(g.group_id for g in result.valid
                      if self.pattern.search(g.group_id) or g.group_id == self.settings.worker.group_id)

    def snapshot(self) -> LagSnapshot:
        started = time.perf_counter()
        # librdkafka's log lines reach Python logging only when the client is polled.
        self.admin.poll(0)
        try:
            names = self._groups()
            groups = self._describe(names)
            committed = self._committed(names)
            topics, brokers = self._metadata()
            self.add_uncommitted(committed, groups, topics, self._pipeline_topics() | {self.settings.topics.receipts})
            exported = {t for (_, t, _) in committed} | (self._pipeline_topics() & topics.keys())
            # Only partitions the metadata knows: offsets a group once committed on a topic since
            # deleted must not fail every refresh (they read as an empty log).
            tps = {(t, p) for t in exported for p in topics.get(t, ())}
            end = self.end_offsets(tps)
            oldest = self._list_offsets(tps, OffsetSpec.earliest())
        except KafkaException as exc:
            err = exc.args[0]
            raise KafkaOperationError("read consumer lag", str(err), err if hasattr(err, "retriable") else None) from exc
        partitions = []
        for (group, topic, partition), offset in sorted(committed.items()):
            log_end = end.get((topic, partition), 0)
            first = oldest.get((topic, partition), 0)
            # What is still in the log past the committed offset (or all of it, never committed);
            # a group may have committed past a truncated log: lag never goes below zero.
            lag = max(0, log_end - max(first, offset if offset is not None else 0))
            partitions.append(PartitionLag(group, topic, partition, offset, log_end, lag))
        if self.time_lag:
            self._oldest_timestamps([p for p in partitions if p.lag > 0])
        return LagSnapshot(int(time.time() * 1000), time.perf_counter() - started, groups, partitions, end,
                           oldest, {t: len(topics[t]) for t in sorted(exported) if t in topics}, brokers)

    def _pipeline_topics(self) -> set[str]:
        t = self.settings.topics
        return {*t.request_topics, *t.dispatch_topics, t.responses, t.dlq, t.cancellations}

    def _metadata(self) -> tuple[dict[str, list[int]], int]:
        """Partitions of every topic the cluster reports (healthy ones), and its broker count."""
        self.round_trips += 1
        md = self.admin.list_topics(timeout=self.request_timeout)
        topics = {name: sorted(tmd.partitions) for name, tmd in md.topics.items() if tmd.error is None}
        return topics, len(md.brokers)

    def _describe(self, names: list[str]) -> dict[str, GroupInfo]:
        if not names:
            return {}
        self.round_trips += 1
        futures = self.admin.describe_consumer_groups(names, request_timeout=self.request_timeout)
        out = {}
        for name, fut in futures.items():
            desc = fut.result()
            topic_members: dict[str, int] = {}
            for member in desc.members:
                topics = {tp.topic for tp in (member.assignment.topic_partitions if member.assignment else [])}
                for t in topics:
                    topic_members[t] = topic_members.get(t, 0) + 1
            out[name] = GroupInfo(name, str(desc.state).rsplit(".", 1)[-1], len(desc.members), topic_members)
        return out

    def _committed(self, names: list[str]) -> dict[tuple[str, str, int], int | None]:
        out: dict[tuple[str, str, int], int | None] = {}
        futures = []
        for name in names:
            self.round_trips += 1
            futures.append(self.admin.list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(name)], request_timeout=self.request_timeout))
        for fmap in futures:
            for name, fut in fmap.items():
                for tp in fut.result().topic_partitions:
                    out[(name, tp.topic, tp.partition)] = tp.offset if tp.offset >= 0 else None
        return out

    @staticmethod
    def add_uncommitted(committed: dict, groups: dict[str, GroupInfo], topics: dict[str, list[int]],
                         work_topics: set[str]) -> None:
        """Partitions of a group's topics it never committed: all their data is lag.

        A group's topics are those it committed on, and the pipeline's ``work_topics`` its members
        are assigned. Other assigned topics are state read by position, never committed: a Faust
        gateway's table changelogs and its assignor's topic. Counting them would show the whole
        changelog as a backlog that grows with every admission."""
        topics_of: dict[str, set[str]] = {}
        for (g, t, _) in committed:
            topics_of.setdefault(g, set()).add(t)
        for g, info in groups.items():
            topics_of.setdefault(g, set()).update(t for t in info.topic_members if t in work_topics)
        for g, ts in topics_of.items():
            for t in ts:
                for p in topics.get(t, ()):
                    committed.setdefault((g, t, p), None)

    def end_offsets(self, tps: set[tuple[str, int]], attempts: int = 3) -> dict[tuple[str, int], int]:
        return self._list_offsets(tps, OffsetSpec.latest(), attempts)

    def _list_offsets(self, tps: set[tuple[str, int]], spec, attempts: int = 3) -> dict[tuple[str, int], int]:
        """Log-end (``OffsetSpec.latest()``) or oldest offsets. A partition whose leader is
        moving (a broker restart, a topic just created) is asked again after a short pause
        rather than failing the whole refresh."""
        out: dict[tuple[str, int], int] = {}
        pending = set(tps)
        for attempt in range(attempts):
            if not pending:
                break
            self.round_trips += 1
            futures = self.admin.list_offsets({TopicPartition(t, p): spec for t, p in pending},
                                              request_timeout=self.request_timeout)
            pending = set()
            for tp, fut in futures.items():
                try:
                    out[(tp.topic, tp.partition)] = fut.result().offset
                except KafkaException as exc:
                    err = exc.args[0]
                    if attempt + 1 == attempts or not _leader_moving(err):
                        raise
                    pending.add((tp.topic, tp.partition))
            if pending:
                time.sleep(0.2 * (attempt + 1))
        return out

    def _oldest_timestamps(self, lagging: list[PartitionLag], timeout: float = 2.0) -> None:
        if not lagging:
            return
        self.round_trips += 1
        consumer = Consumer({**self.settings.kafka.consumer_config(f"llmq-lag-probe-{uuid.uuid4().hex[:8]}"),
                             "enable.partition.eof": False, "fetch.wait.max.ms": 10})
        try:
            wanted = {(p.topic, p.partition): p for p in lagging}
            consumer.assign([TopicPartition(p.topic, p.partition, p.committed if p.committed is not None else -2)
                             for p in lagging])
            deadline = time.monotonic() + timeout
            while wanted and time.monotonic() < deadline:
                for msg in consumer.consume(len(wanted), 0.1):
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                            # A describe-only principal (least privilege) cannot read timestamps.
                            log.warning("no READ permission on %s: time lag is off for this exporter",
                                        msg.topic())
                            self.time_lag = False
                            return
                        continue
                    p = wanted.pop((msg.topic(), msg.partition()), None)
                    if p is not None:
                        p.oldest_timestamp_ms = msg.timestamp()[1]
                        # stop fetching this partition: one message each is all we need
                        consumer.pause([TopicPartition(msg.topic(), msg.partition())])
        finally:
            consumer.close()


class LagCollector:
    """A prometheus_client collector serving the newest snapshot, refreshed in the background."""

    def __init__(self, reader: LagReader, interval_s: float = 15.0):
        self.reader = reader
        self.interval_s = interval_s
        self.snapshot: LagSnapshot | None = None
        self.errors = 0
        self.refreshes = 0
        #: time.monotonic() of the last snapshot read (None: none yet), for /healthz.
        self.refreshed_at: float | None = None
        self._started_at = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._families: tuple | None = None

    def refresh(self) -> bool:
        try:
            self.snapshot = self.reader.snapshot()
            self.refreshes += 1
            self.refreshed_at = time.monotonic()
            self._ready.set()
            return True
        except Exception as exc:  # keep serving the last snapshot; count and log the failure
            self.errors += 1
            log.warning("lag refresh failed (serving the previous snapshot): %s", exc)
            return False

    def start(self) -> "LagCollector":
        def loop():
            while not self._stop.is_set():
                started = time.monotonic()
                ok = self.refresh()
                # After a failure (leader moving, broker restarting) try again soon.
                wait = self.interval_s if ok else min(self.interval_s, 2.0)
                self._stop.wait(max(0.0, wait - (time.monotonic() - started)))

        self._thread = threading.Thread(target=loop, name="llmq-lag-refresh", daemon=True)
        self._thread.start()
        return self

    def stale_for(self, now: float | None = None) -> float | None:
        """Seconds since the last snapshot once that is longer than a few refreshes (the exporter
        serves old lag as if it were now); None while it keeps up."""
        now = time.monotonic() if now is None else now
        since = now - (self.refreshed_at if self.refreshed_at is not None else self._started_at)
        return since if since > max(3 * self.interval_s, 60.0) else None

    def health(self):
        """/healthz: snapshots keep coming; /readyz: there is one."""
        from pipeline.observability.health import Health

        h = Health()

        def fresh() -> str | None:
            stale = self.stale_for()
            return None if stale is None else f"no lag snapshot read for {stale:.0f} s"

        h.add_live("refresh", fresh)
        h.add_ready("snapshot", lambda: None if self._ready.is_set() else "no lag snapshot read yet")
        return h

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Wait for the first successful snapshot."""
        return self._ready.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def collect(self):
        # Families are built once per snapshot, not once per scrape.
        snap, errors = self.snapshot, self.errors
        cached = self._families
        if cached is not None and cached[0] is snap and cached[1] == errors:
            return iter(cached[2])
        families = list(self._build(snap))
        self._families = (snap, errors, families)
        return iter(families)

    def _build(self, snap: LagSnapshot | None):
        settings = self.reader.settings
        lag = GaugeMetricFamily("kafka_consumergroup_lag", "Unconsumed messages per partition (>= 0).",
                                labels=["consumergroup", "topic", "partition"])
        current = GaugeMetricFamily("kafka_consumergroup_current_offset", "Committed offset per partition.",
                                    labels=["consumergroup", "topic", "partition"])
        lag_sum = GaugeMetricFamily("kafka_consumergroup_lag_sum", "Unconsumed messages per group and topic.",
                                    labels=["consumergroup", "topic"])
        current_sum = GaugeMetricFamily("kafka_consumergroup_current_offset_sum",
                                        "Committed offsets per group and topic, summed over the partitions "
                                        "committed (its rate: messages consumed per second).",
                                        labels=["consumergroup", "topic"])
        topic_offset = GaugeMetricFamily("kafka_topic_partition_current_offset", "Log-end offset per partition.",
                                         labels=["topic", "partition"])
        topic_oldest = GaugeMetricFamily("kafka_topic_partition_oldest_offset",
                                         "Oldest offset still in the log per partition.", labels=["topic", "partition"])
        topic_partitions = GaugeMetricFamily("kafka_topic_partitions", "Partitions of each topic.", labels=["topic"])
        brokers = GaugeMetricFamily("kafka_brokers", "Brokers in the cluster's metadata.")
        members = GaugeMetricFamily("kafka_consumergroup_members", "Members of each consumer group.",
                                    labels=["consumergroup"])
        uncommitted = GaugeMetricFamily("llmq_consumergroup_uncommitted_partitions",
                                        "Partitions with data the group has never committed an offset for.",
                                        labels=["consumergroup", "topic"])
        lag_seconds = GaugeMetricFamily("llmq_consumergroup_lag_seconds",
                                        "Age of the oldest unconsumed message (exact, from its timestamp).",
                                        labels=["consumergroup", "topic"])
        depth = GaugeMetricFamily("llmq_queue_depth", "Unconsumed requests per priority band.", labels=["priority"])
        oldest = GaugeMetricFamily("llmq_oldest_request_age_seconds",
                                   "Age of the oldest unconsumed request per priority band.", labels=["priority"])
        consumers = GaugeMetricFamily("llmq_band_consumers", "Group members assigned a band's topics.",
                                      labels=["priority"])
        refresh = GaugeMetricFamily("llmq_lag_exporter_refresh_seconds", "Duration of the last lag refresh.")
        errors = CounterMetricFamily("llmq_lag_exporter_errors", "Failed lag refreshes.")
        errors.add_metric([], self.errors)
        if snap is not None:
            refresh.add_metric([], snap.duration_s)
            brokers.add_metric([], snap.brokers)
            sums: dict[tuple[str, str], int] = {}
            committed_sums: dict[tuple[str, str], int] = {}
            never: dict[tuple[str, str], int] = {}
            ages: dict[tuple[str, str], float] = {}
            for p in snap.partitions:
                labels = [p.group, p.topic, str(p.partition)]
                lag.add_metric(labels, p.lag)
                if p.committed is not None:
                    current.add_metric(labels, p.committed)
                    committed_sums[(p.group, p.topic)] = committed_sums.get((p.group, p.topic), 0) + p.committed
                elif p.end > 0:
                    never[(p.group, p.topic)] = never.get((p.group, p.topic), 0) + 1
                key = (p.group, p.topic)
                sums[key] = sums.get(key, 0) + p.lag
                ages[key] = max(ages.get(key, 0.0), p.time_lag_s(snap.taken_at_ms))
            for (g, t), v in sums.items():
                lag_sum.add_metric([g, t], v)
                lag_seconds.add_metric([g, t], ages[(g, t)])
                uncommitted.add_metric([g, t], never.get((g, t), 0))
            for (g, t), v in sorted(committed_sums.items()):
                current_sum.add_metric([g, t], v)
            for (t, p), v in sorted(snap.end_offsets.items()):
                topic_offset.add_metric([t, str(p)], v)
            for (t, p), v in sorted(snap.oldest_offsets.items()):
                topic_oldest.add_metric([t, str(p)], v)
            for t, n in sorted(snap.topic_partitions.items()):
                topic_partitions.add_metric([t], n)
            for g in snap.groups.values():
                members.add_metric([g.name], g.members)
            for band, info in snap.by_band(settings).items():
                depth.add_metric([band.value], info["depth"])
                oldest.add_metric([band.value], info["oldest_age_s"])
                consumers.add_metric([band.value], info["consumers"])
        yield from (brokers, topic_partitions, topic_offset, topic_oldest, lag, current, lag_sum, current_sum,
                    members, uncommitted, lag_seconds, depth, oldest, consumers, refresh, errors)


def build_registry(collector: LagCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry
