"""The files and batches topics: written here, and read into an in-memory index every
``llmq serve`` process keeps (it tails every partition of both, from the beginning).

Files topic, compacted. A file is ``chunks`` records keyed ``<file id>/<n>`` holding its bytes
in ``batch.chunk_bytes`` pieces, then one record keyed ``<file id>`` with its metadata
(:class:`~pipeline.batch.record.FileRecord`): the metadata is written last, so a file is seen
only once whole. All of a file's records go to one partition (chosen from its id), so they are
read back in one pass. Deleting a file writes tombstones for all its keys.

Batches topic, compacted: one record per batch id (its latest
:class:`~pipeline.batch.record.BatchRecord`), and ``<batch id>/cancel`` once a cancel is asked.

The index holds the metadata and where each chunk is (partition, offset), not the bytes:
:meth:`BatchStore.read_file` fetches them when asked. A write is in the index as soon as it is
delivered (read your writes), and a record read from the topic never replaces one written
later (the index keeps each key's offset).
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from typing import Callable, Iterable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition

from pipeline.batch.record import BatchRecord, FileRecord, cancel_key
from pipeline.errors import KafkaOperationError, LlmqError

log = logging.getLogger("pipeline.batch")

_WRITE_TIMEOUT_S = 30.0


class BatchStore:
    def __init__(self, settings):
        self.settings = settings
        self.topics = settings.topics
        self.chunk_bytes = settings.batch.chunk_bytes
        self._lock = threading.Lock()
        self.files: dict[str, FileRecord] = {}
        self.batches: dict[str, BatchRecord] = {}
        self.cancels: dict[str, int] = {}
        self._chunks: dict[str, dict[int, tuple[int, int]]] = {}
        self._offsets: dict[tuple[str, str], int] = {}  # (topic, key) → offset of the value held
        self._listeners: list[Callable[[str, str], None]] = []
        self._producer = Producer(settings.kafka.producer_config(**{"enable.idempotence": True, "acks": "all",
                                                                     "message.max.bytes": 2 * 1024 * 1024}))
        self._consumer: Consumer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Read both topics to their current end, then keep tailing them in a thread."""
        consumer = Consumer(self.settings.kafka.consumer_config(
            "llmq-batch-index-unused", **{"enable.partition.eof": False, "enable.auto.commit": False,
                                          "fetch.wait.max.ms": 50}))
        parts, ends = [], {}
        for topic in (self.topics.files, self.topics.batches):
            try:
                md = consumer.list_topics(topic, timeout=10).topics.get(topic)
            except KafkaException as exc:
                raise KafkaOperationError(f"describe {topic}", str(exc.args[0]), exc.args[0]) from exc
            if md is None or md.error is not None or not md.partitions:
                raise LlmqError(f"topic {topic!r} does not exist; run `llmq topics create`")
            for p in md.partitions:
                parts.append(TopicPartition(topic, p, OFFSET_BEGINNING))
                lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                if hi > lo:
                    ends[(topic, p)] = hi
        consumer.assign(parts)
        self._consumer = consumer
        deadline = time.monotonic() + timeout
        while ends:
            if time.monotonic() > deadline:
                raise LlmqError(f"reading the batch topics took over {timeout:.0f} s")
            for msg in consumer.consume(500, 0.2):
                if msg.error() is None:
                    self._apply(msg)
                    key = (msg.topic(), msg.partition())
                    if key in ends and msg.offset() + 1 >= ends[key]:
                        del ends[key]
        self._thread = threading.Thread(target=self._tail, name="llmq-batch-index", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._consumer is not None:
            self._consumer.close()
        self._producer.flush(10)

    def on_change(self, listener: Callable[[str, str], None]) -> None:
        """``listener(topic, key)`` after a record of either topic is taken into the index."""
        self._listeners.append(listener)

    def _tail(self) -> None:
        while not self._stop.is_set():
            try:
                for msg in self._consumer.consume(500, 0.2):
                    if msg.error() is None:
                        self._apply(msg)
                self._producer.poll(0)
            except Exception:  # noqa: BLE001 (the index keeps going; the next poll retries)
                log.exception("reading the batch topics failed")
                time.sleep(1)

    # -- the index ---------------------------------------------------------------------------

    def _apply(self, msg) -> None:
        key = msg.key().decode()
        self._take(msg.topic(), key, msg.value(), msg.partition(), msg.offset())

    def _take(self, topic: str, key: str, value: bytes | None, partition: int, offset: int) -> None:
        with self._lock:
            if self._offsets.get((topic, key), -1) > offset:
                return
            self._offsets[(topic, key)] = offset
            if topic == self.topics.files:
                self._take_file(key, value, partition, offset)
            elif key.endswith("/cancel"):
                batch_id = key.rsplit("/", 1)[0]
                if value is None:
                    self.cancels.pop(batch_id, None)
                else:
                    self.cancels[batch_id] = int(value)
            elif value is None:
                self.batches.pop(key, None)
            else:
                self.batches[key] = BatchRecord.from_json(value)
        for listener in self._listeners:
            listener(topic, key)

    def _take_file(self, key: str, value: bytes | None, partition: int, offset: int) -> None:
        file_id, _, n = key.partition("/")
        if n:
            if value is None:
                self._chunks.get(file_id, {}).pop(int(n), None)
            else:
                self._chunks.setdefault(file_id, {})[int(n)] = (partition, offset)
        elif value is None:
            self.files.pop(file_id, None)
            self._chunks.pop(file_id, None)
        else:
            self.files[file_id] = FileRecord.from_json(value)

    # -- reads -------------------------------------------------------------------------------

    def file(self, file_id: str, tenant: str | None = None) -> FileRecord | None:
        with self._lock:
            rec = self.files.get(file_id)
        return rec if rec is not None and (tenant is None or rec.tenant == tenant) else None

    def batch(self, batch_id: str, tenant: str | None = None) -> BatchRecord | None:
        with self._lock:
            rec = self.batches.get(batch_id)
        return rec if rec is not None and (tenant is None or rec.tenant == tenant) else None

    def cancel_asked(self, batch_id: str) -> int | None:
        with self._lock:
            return self.cancels.get(batch_id)

    def list_files(self, tenant: str, purpose: str | None = None) -> list[FileRecord]:
        with self._lock:
            out = [f for f in self.files.values() if f.tenant == tenant and (purpose is None or f.purpose == purpose)]
        return sorted(out, key=lambda f: (f.created_at, f.id), reverse=True)

    def all_batches(self) -> list[BatchRecord]:
        """Every batch, unordered (the driver's look for work, many times a second)."""
        with self._lock:
            return list(self.batches.values())

    def list_batches(self, tenant: str | None = None) -> list[BatchRecord]:
        with self._lock:
            out = [b for b in self.batches.values() if tenant is None or b.tenant == tenant]
        return sorted(out, key=lambda b: (b.created_at, b.id), reverse=True)

    def read_file(self, file_id: str, timeout: float = 60.0) -> bytes:
        """The file's bytes, read back from its chunks."""
        with self._lock:
            rec = self.files.get(file_id)
            where = dict(self._chunks.get(file_id, {}))
        if rec is None:
            raise LlmqError(f"no file {file_id}")
        if len(where) < rec.chunks:
            raise LlmqError(f"file {file_id}: {rec.chunks - len(where)} of its chunks are missing")
        if not rec.chunks:
            return b""
        partition = where[0][0]
        wanted = {offset: n for n, (_, offset) in where.items() if n < rec.chunks}
        parts: dict[int, bytes] = {}
        consumer = Consumer(self.settings.kafka.consumer_config(
            "llmq-batch-read-unused", **{"enable.partition.eof": False, "enable.auto.commit": False,
                                         "fetch.wait.max.ms": 50}))
        try:
            consumer.assign([TopicPartition(self.topics.files, partition, min(wanted))])
            last, deadline = max(wanted), time.monotonic() + timeout
            while len(parts) < len(wanted):
                if time.monotonic() > deadline:
                    raise LlmqError(f"reading file {file_id} took over {timeout:.0f} s")
                for msg in consumer.consume(100, 0.5):
                    if msg.error() is None and msg.offset() in wanted and msg.value() is not None:
                        parts[wanted[msg.offset()]] = msg.value()
                    if msg.error() is None and msg.offset() >= last and len(parts) < len(wanted):
                        raise LlmqError(f"file {file_id} changed while it was read")
        finally:
            consumer.close()
        return b"".join(parts[n] for n in range(rec.chunks))

    # -- writes (each returns once the broker has it) ------------------------------------------

    def partition_of(self, ident: str) -> int:
        return zlib.crc32(ident.encode()) % self.topics.batch_partitions

    def _send(self, topic: str, records: Iterable[tuple[str, bytes | None]], partition: int) -> None:
        errors: list = []

        def delivered(err, msg):
            if err is not None:
                errors.append(err)
            else:
                self._take(msg.topic(), msg.key().decode(), msg.value(), msg.partition(), msg.offset())

        for key, value in records:
            while True:
                try:
                    self._producer.produce(topic, value, key.encode(), partition=partition, on_delivery=delivered)
                    break
                except BufferError:
                    self._producer.poll(0.05)
        left = self._producer.flush(_WRITE_TIMEOUT_S)
        if errors or left:
            reason = errors[0].str() if errors else f"{left} records not delivered in {_WRITE_TIMEOUT_S:.0f} s"
            raise KafkaOperationError(f"write {topic}", reason, errors[0] if errors else None)

    def chunks_of(self, data: bytes) -> list[bytes]:
        size = self.chunk_bytes
        return [data[i:i + size] for i in range(0, len(data), size)]

    def put_file(self, rec: FileRecord, chunks: Iterable[bytes]) -> FileRecord:
        """Write ``chunks`` then ``rec`` (with its chunk count) to the file's partition."""
        pieces = list(chunks)
        rec.chunks = len(pieces)
        records = [(f"{rec.id}/{n}", piece) for n, piece in enumerate(pieces)] + [(rec.id, rec.to_json())]
        self._send(self.topics.files, records, self.partition_of(rec.id))
        return rec

    def delete_file(self, file_id: str) -> None:
        with self._lock:
            rec = self.files.get(file_id)
            keys = [f"{file_id}/{n}" for n in self._chunks.get(file_id, {})]
        if rec is None:
            return
        self._send(self.topics.files, [(file_id, None)] + [(k, None) for k in keys], self.partition_of(file_id))

    def put_batch(self, rec: BatchRecord) -> None:
        self._send(self.topics.batches, [(rec.id, rec.to_json())], self.partition_of(rec.id))

    def ask_cancel(self, batch_id: str, at: int) -> None:
        self._send(self.topics.batches, [(cancel_key(batch_id), str(at).encode())], self.partition_of(batch_id))

    def delete_batch(self, batch_id: str) -> None:
        self._send(self.topics.batches, [(batch_id, None), (cancel_key(batch_id), None)],
                   self.partition_of(batch_id))
