"""Cancellation: ``<prefix>.cancellations``, key = request id, value = the reason (UTF-8 text).

The topic is compacted, so it holds one record per cancelled request for a day. Workers
read all of it (no group: every worker needs every cancellation) and answer a cancelled
request CANCELLED instead of calling the model, or cancel the call if it is in flight.
"""

from __future__ import annotations

import logging
import time
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
    """The cancelled request ids seen so far (newest ``capacity`` kept), fed by :meth:`poll`.

    A topic missing at start (workers started before ``llmq topics create``) is looked for
    again every ``retry_s`` seconds from :meth:`poll`, so cancellations start working once it
    exists instead of staying off until a restart.
    """

    def __init__(self, settings: Settings, capacity: int = 200_000, retry_s: float = 30.0):
        self.topic = settings.topics.cancellations
        self.capacity = capacity
        self.retry_s = retry_s
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._assigned = False
        self._next_look = 0.0
        self._consumer = Consumer(settings.kafka.consumer_config(
            f"llmq-cancellations-{uuid.uuid4().hex[:8]}",  # assign() only: the id is never used
            **{"enable.partition.eof": False, "fetch.wait.max.ms": 50}))
        try:
            found = self._look(timeout=10)
        except KafkaException as exc:
            self._consumer.close()
            self._consumer = None
            raise KafkaOperationError(f"describe {self.topic}", str(exc.args[0]), exc.args[0]) from exc
        if not found:
            log.warning("no %s topic: cancellations are off until it exists (looked for again every %.0f s; "
                        "`llmq topics create` creates it)", self.topic, self.retry_s)

    @property
    def active(self) -> bool:
        """Whether the topic was found and is being read."""
        return self._assigned

    def _look(self, timeout: float) -> bool:
        """Assign the topic's partitions if it exists now."""
        md = self._consumer.list_topics(self.topic, timeout=timeout).topics.get(self.topic)
        if md is None or md.error is not None or not md.partitions:
            self._next_look = time.monotonic() + self.retry_s
            return False
        self._consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in md.partitions])
        self._assigned = True
        return True

    def _look_again(self) -> None:
        if time.monotonic() < self._next_look:
            return
        try:
            found = self._look(timeout=1.0)  # on the caller's loop: keep it short
        except KafkaException as exc:
            self._next_look = time.monotonic() + self.retry_s
            log.info("looking for the %s topic failed (%s); trying again in %.0f s", self.topic, exc, self.retry_s)
            return
        if found:
            log.info("%s topic found: cancellations are on", self.topic)

    def poll(self, max_messages: int = 500) -> list[str]:
        """Read what arrived; returns the newly cancelled ids."""
        if self._consumer is None:
            return []
        if not self._assigned:
            self._look_again()
            if not self._assigned:
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

    def catch_up(self, timeout_s: float = 10.0) -> bool:
        """Read what the topic holds now, before anything is decided on it. A worker that took a
        request before its view had read that request's cancellation would run it, and its
        partition's previous owner may have answered it CANCELLED already (a second, different
        status). True once read to the end seen at the call; False if the topic is missing or not
        read within ``timeout_s`` (:meth:`poll` reads on)."""
        if self._consumer is None or not self._assigned:
            return False
        deadline = time.monotonic() + timeout_s
        consumer = self._consumer
        try:
            assignment = consumer.assignment()
            ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=timeout_s)[1] for tp in assignment}
            while True:
                at = {tp.partition: tp.offset for tp in consumer.position(assignment)}
                if all(end == 0 or at.get(p, -1) >= end for p, end in ends.items()):
                    return True
                if time.monotonic() >= deadline:
                    break
                if not self.poll():
                    time.sleep(0.01)
        except KafkaException as exc:
            log.warning("could not read the %s topic to its end (%s); reading on as it comes", self.topic, exc)
            return False
        log.warning("the %s topic was not read to its end within %.0f s; reading on as it comes", self.topic,
                    timeout_s)
        return False

    def reason(self, request_id: str) -> str | None:
        return self._ids.get(request_id)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
