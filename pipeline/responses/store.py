"""The stored-responses topic: written here, read into an in-memory index by every serve process.

``<prefix>.stored-responses`` is compacted (``cleanup.policy=compact,delete``): one record per
response id, its latest :class:`~pipeline.responses.record.StoredResponse`, kept
``topics.stored_response_config``'s ``retention.ms`` after its last write (30 days by default,
as OpenAI keeps stored responses); a delete writes a tombstone. Every serve process follows the
whole topic (:class:`~pipeline.compacted.CompactedTopic`), so any of them answers for any
response. A write is in the index as soon as the broker acknowledged it (read your writes).

The index holds every stored response, input and output included, in memory: the cost of
having no other store. Retention bounds it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import zlib
from concurrent.futures import Future

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from pipeline.compacted import CompactedTopic
from pipeline.errors import KafkaOperationError
from pipeline.responses.record import StoredResponse

log = logging.getLogger("pipeline.responses")


class ResponseStore:
    def __init__(self, settings):
        self.settings = settings
        self.topic = settings.topics.stored_responses
        self.partitions = settings.topics.stored_response_partitions
        self._lock = threading.Lock()
        self._index: dict[str, StoredResponse] = {}
        self._follower = CompactedTopic(settings, self.topic, apply=self._apply, name="stored responses",
                                        client_id="llmq-stored-responses")
        self._producer = Producer(settings.kafka.producer_config(**{
            "enable.idempotence": True, "acks": "all", "linger.ms": 1, "message.max.bytes": 8 * 1024 * 1024}))
        self._offsets = Consumer(settings.kafka.consumer_config(
            "llmq-stored-responses-unused", **{"enable.partition.eof": False, "enable.auto.commit": False}))
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="llmq-stored-responses-writer", daemon=True)

    def start(self, wait_s: float = 60.0) -> "ResponseStore":
        self._poller.start()
        self._follower.start(wait_s)
        return self

    def stop(self) -> None:
        self._follower.stop()
        self._producer.flush(10)
        self._stop.set()
        self._poller.join(2)
        self._offsets.close()

    @property
    def ready(self) -> bool:
        return self._follower.ready and self._follower.running

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.1)

    # -- the index -----------------------------------------------------------------------------

    def _apply(self, pairs) -> None:
        for key, value in pairs:
            if key is None:
                continue
            self._take(key.decode(), None if value is None else StoredResponse.from_json(value))

    def _take(self, response_id: str, rec: StoredResponse | None) -> None:
        with self._lock:
            if rec is None:
                self._index.pop(response_id, None)
            elif rec.replaces(self._index.get(response_id)):
                self._index[response_id] = rec

    def get(self, response_id: str, tenant: str | None = None) -> StoredResponse | None:
        with self._lock:
            rec = self._index.get(response_id)
        return rec if rec is not None and (tenant is None or rec.tenant == tenant) else None

    def pending(self) -> list[StoredResponse]:
        """The responses not ended yet (background ones: only those are stored before they end)."""
        with self._lock:
            return [r for r in self._index.values() if not r.terminal]

    def chain(self, response_id: str, tenant: str, limit: int) -> list[StoredResponse] | None:
        """The responses of a conversation ending with ``response_id``, oldest first; None when
        one of them is not there (another tenant's is as unknown as none); at most ``limit``+1
        (the caller refuses a longer one)."""
        out: list[StoredResponse] = []
        ident: str | None = response_id
        while ident is not None and len(out) <= limit:
            rec = self.get(ident, tenant)
            if rec is None:
                return None
            out.append(rec)
            ident = rec.previous_response_id
        return list(reversed(out))

    # -- writes ----------------------------------------------------------------------------------

    def partition_of(self, response_id: str) -> int:
        return zlib.crc32(response_id.encode()) % self.partitions

    def _write(self, response_id: str, rec: StoredResponse | None) -> Future:
        fut: Future = Future()

        def delivered(err, msg):
            if err is not None:
                fut.set_exception(KafkaOperationError(f"write {self.topic}", err.str(), err))
            else:
                self._take(response_id, rec)
                fut.set_result(None)

        value = None if rec is None else rec.to_json()
        while True:
            try:
                self._producer.produce(self.topic, value, response_id.encode(), partition=self.partition_of(response_id),
                                       on_delivery=delivered)
                return fut
            except BufferError:
                self._producer.poll(0.05)

    async def put(self, rec: StoredResponse, timeout: float = 30.0) -> None:
        """Write ``rec``; returns once the broker has it (KafkaOperationError otherwise)."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._write(rec.id, rec)), timeout)
        except asyncio.TimeoutError:
            raise KafkaOperationError(f"write {self.topic}", f"not acknowledged within {timeout:.0f} s") from None

    async def delete(self, response_id: str, timeout: float = 30.0) -> None:
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._write(response_id, None)), timeout)
        except asyncio.TimeoutError:
            raise KafkaOperationError(f"write {self.topic}", f"not acknowledged within {timeout:.0f} s") from None

    def end_offset(self, topic: str, partition: int) -> int:
        """Where ``partition`` of ``topic`` ends now (blocking: call it off the event loop)."""
        try:
            return self._offsets.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)[1]
        except KafkaException as exc:
            raise KafkaOperationError(f"read where {topic}[{partition}] ends", str(exc.args[0]), exc.args[0]) from exc
