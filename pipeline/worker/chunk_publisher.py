"""Streamed answers: a request with ``stream`` set is called with the backend's ``stream()``,
and each piece of text is published as it comes, as an ``LLMChunk`` on the chunks topic.

Chunks are progress, best effort: keyed by request id, numbered ``seq`` 0, 1, 2, ... in
order, the last with ``finish_reason``, in the request's ``reply_partition`` when it has
one (else the tenant's partition, as responses are partitioned), so a client reads one
partition for both. They are not retried and do not hold commits back: the request's one
terminal response, with the whole text, is what finishes its offset. A request run again
(a crash before its answer was committed, a partition moved) streams again from seq 0, so
a reader drops what it has seen by seq (pipeline/chunks.py).

Exactly-once, answers go out in the transaction that commits their offsets, once per commit
interval; chunks cannot wait for it. They are produced outside any transaction, by a producer
of their own (a transactional producer cannot produce between transactions), so a
read_committed reader sees them at once, and sees those of a run whose transaction is later
aborted too.
"""

from __future__ import annotations

import logging
import time
from contextlib import aclosing

from confluent_kafka import KafkaException, Producer

from pipeline.config import Settings
from pipeline.errors import EncodeError
from pipeline.models import Chunk, Request
from pipeline.observability.metrics import WorkerMetrics
from pipeline.chunks import chunk_partition
from pipeline.serde import Codec
from pipeline.worker.backends.base import Completion
from pipeline.worker.state import Session

log = logging.getLogger(__name__)


class ChunkPublisher:
    def __init__(self, settings: Settings, codec: Codec, worker_id: str, session: Session, exactly_once: bool):
        self.settings = settings
        self.topic = settings.topics.chunks
        self.partitions = settings.topics.chunk_partitions
        self.wire = settings.serde.wire_format
        self.codec = codec
        self.worker_id = worker_id
        self.session = session
        self.exactly_once = exactly_once
        self.published = 0
        self.lost = 0  # refused locally or not acknowledged: best effort, not retried

    def producer(self):
        """At-least-once, the worker's producer; exactly-once, a plain one of its own."""
        session = self.session
        if not self.exactly_once:
            return session.producer
        if session.chunk_producer is None:
            session.chunk_producer = Producer(self.settings.kafka.producer_config(
                **{"client.id": f"llmq-worker-{self.worker_id}-chunks", "linger.ms": 0}))
        return session.chunk_producer

    def partition(self, request: Request) -> int:
        return chunk_partition(self.partitions, request.tenant_id, request.reply_partition)

    def publish(self, request: Request, partition: int, seq: int, delta: str, finish_reason: str | None) -> None:
        chunk = Chunk(request_id=request.request_id, tenant_id=request.tenant_id, seq=seq, delta=delta,
                      finish_reason=finish_reason, emitted_at=int(time.time() * 1000), worker_id=self.worker_id)
        try:
            value = self.codec.encode_chunk(chunk, self.wire, self.topic)
        except EncodeError as exc:
            # Too long for the output cap: the terminal answer says so (it is checked the same way).
            log.warning("chunk %d of %s not published: %s", seq, request.request_id, exc)
            self.lost += 1
            return
        producer = self.producer()
        if producer is None:  # abandoned in a stuck transactional call (at-least-once never is)
            self.lost += 1
            return
        try:
            producer.produce(self.topic, value, request.request_id.encode(), partition=partition,
                             on_delivery=self._delivered)
        except (BufferError, KafkaException) as exc:
            # A full local queue is not waited for: the stream goes on, its answer has the text.
            self.lost += 1
            log.debug("chunk %d of %s not queued: %s", seq, request.request_id, exc)
            return
        self.published += 1

    def _delivered(self, err, msg) -> None:
        if err is not None:
            self.lost += 1
            log.info("chunk of %s not delivered: %s", (msg.key() or b"").decode("utf-8", "replace"), err)

    def poll(self) -> None:
        producer = self.session.chunk_producer
        if producer is not None:
            producer.poll(0)

    def close(self) -> None:
        producer, self.session.chunk_producer = self.session.chunk_producer, None
        if producer is not None:
            producer.flush(5)


async def stream_completion(backend, request: Request, slot, publisher: ChunkPublisher, metrics: WorkerMetrics,
                            on_first_token) -> Completion:
    """Call ``backend.stream(request)``, publish each piece as a chunk, and return the whole
    answer. ``on_first_token()`` runs when the first piece is out (the call is no longer
    preemptible: run again, it would send its pieces again). Cancelling the task that awaits
    this closes the backend's stream (and with it the HTTP response: the server stops)."""
    stream = backend.stream(request) if slot is None else backend.stream(request, slot)
    partition = publisher.partition(request)
    band = request.serving_priority._value_
    parts: list[str] = []
    seq = 0
    last_at = None
    final = None
    async with aclosing(stream) as pieces:
        async for piece in pieces:
            if piece.usage is not None:  # the last one: finish_reason and usage
                final = piece
                if piece.text:
                    parts.append(piece.text)
                break
            if not piece.text:
                continue
            now = time.time()
            if last_at is None:
                metrics.first_token(band, now - request.created_at / 1000.0)
                on_first_token()
            else:
                metrics.next_token(band, now - last_at)
            last_at = now
            parts.append(piece.text)
            publisher.publish(request, partition, seq, piece.text, None)
            seq += 1
    if final is None:
        from pipeline.errors import BackendError

        raise BackendError("the model's stream ended without its last chunk", retriable=True)
    # A server that gave no reason: the answer ended because the model stopped.
    reason = final.finish_reason or "stop"
    publisher.publish(request, partition, seq, final.text or "", reason)
    usage = final.usage
    return Completion("".join(parts), usage.prompt_tokens, usage.completion_tokens, request.model,
                      finish_reason=reason, usage_estimated=usage.estimated)
