"""A compacted topic followed live: read from its beginning on a thread, then every new record.

The tenant registry and the model catalog are each a small table kept in a compacted topic
(one record per key, a tombstone drops it). Every process that decides with them holds a
follower: it reads what the topic held at start before it calls itself ready, then applies
each later batch of records as it arrives, and writes records acknowledged one at a time::

    topic = CompactedTopic(settings, "llm.tenants", apply=registry.apply, name="tenant registry",
                           ensure=registry.ensure)
    topic.start(wait_s=30)            # raises LlmqError when the topic cannot be read to its end
    topic.publish(b"acme", b"{...}")  # returns once acknowledged
    topic.stop()

``apply`` is called on the reader thread with a list of ``(key, value)`` pairs (value None: a
tombstone). No consumer group: the partitions are assigned, nothing is committed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition

from pipeline.errors import KafkaOperationError, LlmqError

log = logging.getLogger(__name__)

Apply = Callable[[Iterable[tuple[bytes | None, bytes | None]]], object]


class CompactedTopic:
    def __init__(self, settings, topic: str, *, apply: Apply, name: str,
                 ensure: Callable[[], bool] | None = None, client_id: str | None = None):
        self.settings = settings
        self.topic = topic
        self.name = name
        self._apply = apply
        self._ensure = ensure
        self._client_id = client_id or f"llmq-{topic.rsplit('.', 1)[-1]}"
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self, wait_s: float = 30.0) -> "CompactedTopic":
        """Follow the topic on a thread; returns once what it held at start is applied (or raises)."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name=self._client_id, daemon=True)
        self._thread.start()
        if wait_s and not self._ready.wait(wait_s):
            if self._error is not None:
                raise LlmqError(f"{self.name}: {self._error}")
            raise LlmqError(f"{self.name}: {self.topic} not read to its end within {wait_s:.0f}s")
        return self

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def publish(self, key: bytes, value: bytes | None, timeout: float = 15.0) -> None:
        """Write one record (None: a tombstone); returns once it is acknowledged, else raises."""
        producer = Producer(self.settings.kafka.producer_config(**{"client.id": self._client_id, "linger.ms": 0}))
        errors: list = []
        producer.produce(self.topic, value, key, on_delivery=lambda err, msg: errors.append(err))
        what = key.decode(errors="replace")
        remaining = producer.flush(timeout)
        if remaining or not errors:
            raise KafkaOperationError(f"write {self.name} record {what}", f"not acknowledged within {timeout:.0f}s")
        if errors[0] is not None:
            raise KafkaOperationError(f"write {self.name} record {what} to {self.topic}", errors[0].str(), errors[0])

    def _run(self) -> None:
        try:
            consumer = self._consumer()
        except BaseException as exc:  # noqa: BLE001 (reported through start())
            self._error = exc
            return
        try:
            highs = self._assign(consumer)
            while not self._stopping.is_set():
                pairs = []
                for msg in consumer.consume(500, 0.1):
                    if msg.error() is not None:
                        if msg.error().code() != KafkaError._PARTITION_EOF:
                            log.info("%s: %s", self.name, msg.error().str())
                        continue
                    pairs.append((msg.key(), msg.value()))
                if pairs:
                    self._apply(pairs)
                if highs is not None and not self._ready.is_set():
                    positions = consumer.position([TopicPartition(self.topic, p) for p in highs])
                    if all(tp.offset >= highs[tp.partition] or highs[tp.partition] == 0 for tp in positions):
                        self._ready.set()
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
            log.error("%s reader stopped: %s", self.name, exc)
        finally:
            consumer.close()

    def _consumer(self) -> Consumer:
        return Consumer(self.settings.kafka.consumer_config(
            f"{self._client_id}-unused",  # assign() below: no group, no commits
            **{"client.id": self._client_id, "enable.partition.eof": False, "fetch.wait.max.ms": 50}))

    def _assign(self, consumer: Consumer) -> dict[int, int] | None:
        """Assign every partition from the beginning; the high watermarks to reach before ready."""
        created = False
        while not self._stopping.is_set():
            try:
                md = consumer.list_topics(self.topic, timeout=10).topics.get(self.topic)
            except KafkaException as exc:
                log.info("%s: cannot describe %s (%s); retrying", self.name, self.topic, exc.args[0].str())
                time.sleep(1)
                continue
            if md is not None and md.error is None and md.partitions:
                break
            if md is not None and md.error is not None and md.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                raise LlmqError(f"not authorized to read {self.topic} (see `llmq acls`)")
            if not created and self._ensure is not None:
                created = True
                self._ensure()
                continue
            time.sleep(0.5)
        else:
            return None
        highs = self._high_watermarks(consumer, md.partitions)
        consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in md.partitions])
        if not any(highs.values()):
            self._ready.set()
        return highs

    def _high_watermarks(self, consumer: Consumer, partitions) -> dict[int, int]:
        """Where each partition ends now. Asked again while a partition has no leader (a broker
        of a replicated cluster down): start() bounds the wait, not the first refusal."""
        while True:
            try:
                return {p: consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10)[1]
                        for p in partitions}
            except KafkaException as exc:
                if self._stopping.is_set():
                    raise
                log.info("%s: cannot read where %s ends (%s); retrying", self.name, self.topic, exc.args[0].str())
                time.sleep(1)
