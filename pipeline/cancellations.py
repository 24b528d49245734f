"""Cancellation: ``<prefix>.cancellations``, key = request id, value = the reason (UTF-8 text).

The topic is compacted, so it holds one record per cancelled request for a day. Workers
read all of it (no group: every worker needs every cancellation) and answer a cancelled
request CANCELLED instead of calling the model, or cancel the call if it is in flight.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from pipeline.config import Settings
from pipeline.errors import KafkaOperationError

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 200


def cancellation_record(request_id: str, reason: str = "cancelled by the client") -> tuple[bytes, bytes]:
    """(key, value) of a cancellation, for any producer."""
    return request_id.encode(), reason[:MAX_REASON_CHARS].encode("utf-8", "replace")


class CancellationView:
    """The cancelled request ids seen so far (newest ``capacity`` kept), fed by :meth:`poll`."""

    def __init__(self, settings: Settings, capacity: int = 200_000):
        self.topic = settings.topics.cancellations
        self.capacity = capacity
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._consumer = Consumer(settings.kafka.consumer_config(
            f"llmq-cancellations-{uuid.uuid4().hex[:8]}",  # assign() only: the id is never used
            **{"enable.partition.eof": False, "fetch.wait.max.ms": 50}))
        try:
            md = self._consumer.list_topics(self.topic, timeout=10).topics.get(self.topic)
        except KafkaException as exc:
            self._consumer.close()
            raise KafkaOperationError(f"describe {self.topic}", str(exc.args[0]), exc.args[0]) from exc
        if md is None or md.error is not None or not md.partitions:
            self._consumer.close()
            self._consumer = None
            log.warning("no %s topic: cancellations are off (run `llmq topics create`)", self.topic)
            return
        self._consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in md.partitions])

    def poll(self, max_messages: int = 500) -> list[str]:
        """Read what arrived; returns the newly cancelled ids."""
        if self._consumer is None:
            return []
        new = []
        for msg in self._consumer.consume(max_messages, 0):
            if msg.error() is not None or msg.key() is None:
                continue
            request_id = msg.key().decode("utf-8", "replace")[:64]
            if msg.value() is None:  # a tombstone withdraws the cancellation
                self._ids.pop(request_id, None)
                continue
            self._ids[request_id] = msg.value().decode("utf-8", "replace")[:MAX_REASON_CHARS]
            self._ids.move_to_end(request_id)
            if len(self._ids) > self.capacity:
                self._ids.popitem(last=False)
            new.append(request_id)
        return new

    def reason(self, request_id: str) -> str | None:
        return self._ids.get(request_id)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
