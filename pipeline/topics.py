"""Topic names and specs, and their idempotent creation and verification."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from pipeline.config import Settings
from pipeline.errors import KafkaOperationError, TopicMismatchError


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str] = field(default_factory=dict)
    role: str = ""


@dataclass
class TopicReport:
    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)
    #: (topic, configured partitions, actual partitions)
    mismatched: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatched

    def describe(self) -> str:
        lines = [f"created  {t}" for t in self.created]
        lines += [f"exists   {t}" for t in self.existing]
        lines += [f"MISMATCH {t}: configured {want} partitions, broker has {have}"
                  for t, want, have in self.mismatched]
        return "\n".join(lines)


def pipeline_topics(settings: Settings) -> list[TopicSpec]:
    t = settings.topics
    specs = [TopicSpec(name, t.request_partitions, t.replication_factor, dict(t.request_config), "requests")
             for name in t.request_topics]
    specs += [TopicSpec(name, t.dispatch_partitions, t.replication_factor, dict(t.request_config), "admitted")
              for name in t.dispatch_topics]
    specs.append(TopicSpec(t.responses, t.response_partitions, t.replication_factor, dict(t.response_config), "responses"))
    specs.append(TopicSpec(t.dlq, t.dlq_partitions, t.replication_factor, dict(t.dlq_config), "dead letters"))
    specs.append(TopicSpec(t.cancellations, t.cancellation_partitions, t.replication_factor,
                           dict(t.cancellation_config), "cancellations"))
    specs.append(TopicSpec(t.chunks, t.chunk_partitions, t.replication_factor, dict(t.chunk_config),
                           "streamed chunks"))
    specs.append(TopicSpec(t.receipts, t.request_partitions, t.replication_factor, dict(t.receipt_config),
                           "completion receipts"))
    specs += [TopicSpec(name, t.batch_partitions, t.replication_factor, dict(t.batch_config), role)
              for name, role in ((t.files, "batch files"), (t.batches, "batches"))]
    specs.append(TopicSpec(t.stored_responses, t.stored_response_partitions, t.replication_factor,
                           dict(t.stored_response_config), "stored responses"))
    specs.append(model_catalog_topic(settings))
    if t.replication_factor > 1:
        # Set on the topic, not left to the broker's default: acks=all then means what the
        # settings say on any cluster.
        isr = {"min.insync.replicas": str(t.min_isr)}
        specs = [TopicSpec(s.name, s.partitions, s.replication_factor, {**isr, **s.config}, s.role) for s in specs]
    return specs


def model_catalog_topic(settings: Settings) -> TopicSpec:
    """The pools' model lists (pipeline/catalog/): one small record per pool, compacted."""
    t = settings.topics
    return TopicSpec(settings.models.topic(t.prefix), 1, t.replication_factor,
                     {"cleanup.policy": "compact", "min.compaction.lag.ms": "0"}, "model catalog")


def ensure_topics(admin: AdminClient, specs: list[TopicSpec], timeout: float = 30.0) -> TopicReport:
    """Create missing topics; report existing ones whose partition count differs.

    Never alters an existing topic: shrinking is impossible in Kafka and growing changes
    which partition a tenant's key hashes to, so that is left to an operator's decision.
    """
    report = TopicReport()
    try:
        existing = admin.list_topics(timeout=timeout).topics
    except KafkaException as exc:
        raise KafkaOperationError("list topics", str(exc.args[0]), exc.args[0]) from exc
    missing = []
    for spec in specs:
        md = existing.get(spec.name)
        if md is None or md.error is not None and md.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            missing.append(spec)
            continue
        have = len(md.partitions)
        if have != spec.partitions:
            report.mismatched.append((spec.name, spec.partitions, have))
        else:
            report.existing.append(spec.name)
    if missing:
        futures = admin.create_topics(
            [NewTopic(s.name, num_partitions=s.partitions, replication_factor=s.replication_factor, config=s.config)
             for s in missing],
            operation_timeout=timeout, request_timeout=timeout)
        for name, fut in futures.items():
            try:
                fut.result()
                report.created.append(name)
            except KafkaException as exc:
                err = exc.args[0]
                if err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    # Created concurrently by another process: verify like any existing topic.
                    report.existing.append(name)
                else:
                    raise KafkaOperationError(f"create topic {name}", err.str(), err) from exc
        wait_visible(admin, [s.name for s in missing], timeout)
    return report


def wait_visible(admin: AdminClient, names: list[str], timeout: float = 30.0) -> None:
    """Return once the broker's metadata lists every topic of ``names`` with its partitions.

    A created topic reaches the controller first and the brokers' metadata a moment later:
    a client that subscribes, describes or produces in between is told it does not exist."""
    deadline = time.monotonic() + timeout
    pending = set(names)
    while pending:
        listed = admin.list_topics(timeout=timeout).topics
        pending = {n for n in pending if n not in listed or listed[n].error is not None or not listed[n].partitions}
        if not pending:
            return
        if time.monotonic() > deadline:
            raise KafkaOperationError("create topics", f"not visible after {timeout:.0f} s: {', '.join(sorted(pending))}")
        time.sleep(0.1)


def create_pipeline_topics(settings: Settings, strict: bool = True) -> TopicReport:
    admin = AdminClient(settings.kafka.admin_config())
    report = ensure_topics(admin, pipeline_topics(settings))
    if strict and not report.ok:
        raise TopicMismatchError(report.describe())
    return report
