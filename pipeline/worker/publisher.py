"""Getting an outcome's bytes to the broker, whatever the producer says.

The responder decides what a request's one outcome is; this part makes sure it goes out: it
produces however long the local queue stays full, shrinks a message the broker or producer
refuses as too large (a response becomes a FAILED one without its output, a dead letter keeps
its head and says how long it was), and sends a reply whose topic or partition turns out not
to exist to the responses topic instead. Either way the request still ends in exactly one
outcome and its partition moves on. The offset checkpoint uses it for the outcomes a
transaction's plain produce refused; the responder for everything at-least-once.
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaError, KafkaException

from pipeline.config import Settings
from pipeline.dlq import H_TRUNCATED
from pipeline.models import Response, Status, now_ms
from pipeline.observability.metrics import WorkerMetrics
from pipeline.partitioning import ANY_PARTITION
from pipeline.serde import Codec
from pipeline.worker.records import rd_partition
from pipeline.worker.replies import ReplyTargets
from pipeline.worker.state import Session, WorkerStats

log = logging.getLogger(__name__)

#: The broker or the producer knows no such topic or partition (a reply destination).
UNKNOWN_DESTINATION = frozenset((KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC,
                                 KafkaError.UNKNOWN_TOPIC_OR_PART))

#: What a dead letter too large to publish keeps of its value and key.
_KEPT_VALUE_BYTES = 65536
_KEPT_KEY_BYTES = 1024


class Publisher:
    def __init__(self, settings: Settings, codec: Codec, worker_id: str, session: Session, targets: ReplyTargets,
                 stats: WorkerStats, metrics: WorkerMetrics):
        self.codec = codec
        self.wire = settings.serde.wire_format
        self.worker_id = worker_id
        self.responses_topic = settings.topics.responses
        self.dlq_topic = settings.topics.dlq
        self.session = session
        self.targets = targets
        self.stats = stats
        self.metrics = metrics

    def produce(self, topic: str, value, key, headers, on_delivery, partition: int | None = ANY_PARTITION) -> None:
        """Produce, however long the local queue stays full, shrunk if it is too large, and to
        the responses topic if a reply topic or partition turns out not to exist."""
        producer = self.session.producer
        while True:
            try:
                producer.produce(topic, value, key, headers=headers, on_delivery=on_delivery,
                                 partition=rd_partition(partition))
                return
            except BufferError:
                # Local queue full: serve delivery reports until there is room.
                producer.poll(0.05)
            except KafkaException as exc:
                code = exc.args[0].code()
                if code in UNKNOWN_DESTINATION:
                    instead = self.targets.fallback(topic, partition)
                    if instead is None:
                        raise
                    topic, partition = instead
                    continue
                if code != KafkaError.MSG_SIZE_TOO_LARGE:
                    raise
                topic, value, key, headers = self.shrunk(topic, value, key, headers)

    def shrunk(self, topic: str, value, key, headers) -> tuple:
        """``(topic, value, key, headers)`` of a message refused as too large, made small enough
        to publish."""
        if topic == self.dlq_topic:
            own = [(k, v) for k, v in (headers or []) if k.startswith("llmq.dlq.")]
            size = len(value or b"") + len(key or b"") + sum(len(k) + len(v or b"") for k, v in (headers or []))
            log.warning("dead letter of %d bytes exceeds the size limit; keeping its head", size)
            return (topic, (value or b"")[:_KEPT_VALUE_BYTES], (key or b"")[:_KEPT_KEY_BYTES],
                    own + [(H_TRUNCATED, str(size).encode())])
        response = self.codec.decode_response(value)
        return topic, self.failed_instead(response, "response_too_large: the broker refused its size"), key, None

    def failed_instead(self, response: Response, reason: str) -> bytes:
        """The encoded FAILED answer that replaces ``response`` when it cannot be sent as it is."""
        log.warning("request %s answered FAILED: %s", response.request_id, reason)
        self.stats.failed += 1
        self.metrics.outcome(response.requested_priority._value_, "failed")
        failed = Response(
            request_id=response.request_id, tenant_id=response.tenant_id, status=Status.FAILED, reason=reason[:500],
            model=None, degraded=response.degraded, requested_priority=response.requested_priority,
            served_priority=response.served_priority,
            created_at=response.created_at, admitted_at=response.admitted_at, started_at=response.started_at,
            finished_at=now_ms(), worker_id=self.worker_id)
        return self.codec.encode_response(failed, self.wire, self.responses_topic)
