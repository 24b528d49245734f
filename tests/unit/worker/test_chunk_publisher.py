"""Streamed requests: each piece of text goes out as a chunk, in order; the one terminal answer
has the whole text; answers go where the request asked.

Driven without a broker: the fake producer acknowledges at once and keeps what it was given.
"""

from __future__ import annotations

import asyncio

from confluent_kafka import KafkaError, KafkaException

from pipeline.config import Settings
from pipeline.models import Priority, Request, Status
from pipeline.serde import Codec
from pipeline.testing import FakeMessage
from pipeline.partitioning import ANY_PARTITION
from pipeline.worker.backends.base import Piece, Usage
from pipeline.worker.backends.simulated import SimulatedBackend
from pipeline.worker.loop import Worker
from pipeline.partitioning import tenant_partition
from tests.unit.worker.test_admission_fuzz import FakeProducer

CODEC = Codec.default()


class MetadataProducer(FakeProducer):
    """Knows ``topics`` (name → partition count); refuses partitions past the end, as librdkafka does."""

    def __init__(self, topics: dict[str, int]):
        super().__init__()
        self.topics = topics

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None, partition=-1, **kw):
        if partition >= 0 and partition >= self.topics.get(topic, 0):
            raise KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION))
        super().produce(topic, value, key, headers, on_delivery, partition=partition, **kw)

    def list_topics(self, topic=None, timeout=None):
        count = self.topics.get(topic)

        class Meta:
            error = None if count else KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
            partitions = {p: None for p in range(count or 0)}

        class Cluster:
            topics = {topic: Meta()}

        return Cluster()


def make_worker(backend=None, producer=None, **worker) -> Worker:
    s = Settings.load(env={})
    for name, value in worker.items():
        setattr(s.worker, name, value)
    w = Worker(s, backend or SimulatedBackend(latency_ms=5, ms_per_token=2), worker_id="stream-worker")
    w.session.producer = producer or FakeProducer()
    return w


def take(worker: Worker, request: Request, offset: int = 0) -> None:
    topic = worker.settings.topics.request_topic(request.priority)
    worker.take(FakeMessage(topic, 0, offset, CODEC.encode_request(request), request.tenant_id.encode()))


def sent(worker: Worker, topic: str) -> list:
    return [m for m in worker.producer.sent if m.topic() == topic]


async def until(condition, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def test_a_streamed_request_publishes_its_pieces_in_order_then_one_answer_with_the_whole_text():
    async def run():
        worker = make_worker()
        request = Request.new("tenant-s", "tell me", priority=Priority.HIGH, max_tokens=6, stream=True)
        take(worker, request)
        assert worker.dispatch() == 1
        await until(lambda: sent(worker, worker.responses_topic))
        return worker, request

    worker, request = asyncio.run(run())
    chunks_topic = worker.settings.topics.chunks
    msgs = sent(worker, chunks_topic)
    chunks = [CODEC.decode_chunk(m.value()) for m in msgs]
    assert [c.seq for c in chunks] == list(range(7))  # 6 words, then the closing chunk
    assert all(m.key() == request.request_id.encode() for m in msgs)
    assert all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].finish_reason == "length"
    assert all(c.worker_id == "stream-worker" and c.tenant_id == "tenant-s" for c in chunks)
    expected = tenant_partition(b"tenant-s", worker.settings.topics.chunk_partitions)
    assert {m.partition() for m in msgs} == {expected}
    (msg,) = sent(worker, worker.responses_topic)
    response = CODEC.decode_response(msg.value())
    assert response.status is Status.COMPLETED and response.output == "".join(c.delta for c in chunks)
    assert response.output == SimulatedBackend(max_output_tokens=16).answer(request).output
    assert response.completion_tokens == 6 and response.finish_reason == "length" and not response.usage_estimated
    assert worker.metrics.ttft.labels("HIGH").counts[-1] == 0 and sum(worker.metrics.ttft.labels("HIGH").counts) == 1
    assert sum(worker.metrics.inter_token.labels("HIGH").counts) == 5


def test_a_request_that_is_not_streamed_publishes_no_chunk_and_says_why_it_ended():
    async def run():
        worker = make_worker()
        take(worker, Request.new("t", "hello", max_tokens=3))
        worker.dispatch()
        await until(lambda: sent(worker, worker.responses_topic))
        return worker

    worker = asyncio.run(run())
    assert sent(worker, worker.settings.topics.chunks) == []


def test_chunks_and_the_answer_go_to_the_reply_partition_and_the_answer_to_the_reply_topic():
    async def run():
        s = Settings.load(env={})
        reply_to = f"{s.topics.prefix}.replies.frontend-1"
        producer = MetadataProducer({reply_to: 4, s.topics.responses: 6, s.topics.chunks: 6})
        worker = make_worker(producer=producer)
        request = Request.new("t", "hello", max_tokens=3, stream=True, reply_to=reply_to, reply_partition=3)
        take(worker, request)
        worker.dispatch()
        await until(lambda: sent(worker, reply_to))
        return worker, reply_to

    worker, reply_to = asyncio.run(run())
    assert {m.partition() for m in sent(worker, worker.settings.topics.chunks)} == {3}
    (answer,) = sent(worker, reply_to)
    assert answer.partition() == 3 and sent(worker, worker.responses_topic) == []


def test_a_reply_destination_that_does_not_exist_falls_back_to_the_responses_topic():
    async def run():
        s = Settings.load(env={})
        producer = MetadataProducer({s.topics.responses: 6, s.topics.chunks: 6})
        worker = make_worker(producer=producer)
        missing = Request.new("t", "a", max_tokens=2, reply_to=f"{s.topics.prefix}.replies.gone")
        too_far = Request.new("t", "b", max_tokens=2, reply_partition=99, stream=True)
        outside = Request.new("t", "c", max_tokens=2, reply_to="other.replies")  # refused by validation
        for offset, r in enumerate((missing, too_far, outside)):
            take(worker, r, offset)
        worker.dispatch()
        await until(lambda: len(sent(worker, worker.responses_topic)) == 3)
        return worker, missing, too_far, outside

    worker, missing, too_far, outside = asyncio.run(run())
    answers = {CODEC.decode_response(m.value()).request_id: CODEC.decode_response(m.value())
               for m in sent(worker, worker.responses_topic)}
    assert answers[missing.request_id].status is Status.COMPLETED
    assert answers[too_far.request_id].status is Status.COMPLETED
    assert answers[outside.request_id].status is Status.REJECTED
    assert "reply_to" in answers[outside.request_id].reason
    # Past the chunk topic's partitions: the tenant's partition instead.
    assert {m.partition() for m in sent(worker, worker.settings.topics.chunks)} == {
        tenant_partition(b"t", worker.settings.topics.chunk_partitions)}
    assert worker.checkpoint.tracker.to_commit()[0][1] == 3


class EndlessBackend:
    """Streams one word every few milliseconds until it is closed."""

    name = "endless"

    def __init__(self):
        self.closed = asyncio.Event()
        self.pieces = 0

    def complete_now(self, request):
        return None

    async def complete(self, request):
        raise AssertionError("a streamed request is called with stream()")

    async def stream(self, request):
        try:
            while True:
                await asyncio.sleep(0.002)
                yield Piece(self.pieces, "word ")
                self.pieces += 1
        finally:
            self.closed.set()

    async def close(self):
        return None


def test_cancelling_a_stream_closes_the_backends_stream_and_answers_cancelled():
    async def run():
        backend = EndlessBackend()
        worker = make_worker(backend)
        request = Request.new("t", "go on", max_tokens=10_000, stream=True)
        take(worker, request)
        worker.dispatch()
        await until(lambda: backend.pieces >= 5)
        worker.session.cancellations = type("View", (), {"reason": lambda self, rid: "user closed the tab"})()
        worker.processor.cancel(request.request_id)
        await asyncio.wait_for(backend.closed.wait(), 5)
        await until(lambda: sent(worker, worker.responses_topic))
        return worker

    worker = asyncio.run(run())
    (msg,) = sent(worker, worker.responses_topic)
    response = CODEC.decode_response(msg.value())
    assert response.status is Status.CANCELLED and response.reason == "cancelled: user closed the tab"
    assert len(sent(worker, worker.settings.topics.chunks)) >= 5


def test_a_stream_whose_first_tokens_are_out_is_not_preempted():
    async def run():
        backend = EndlessBackend()
        worker = make_worker(backend, max_inflight=1)
        slow = Request.new("bulk", "go on", priority=Priority.BACKGROUND, max_tokens=10_000, stream=True)
        take(worker, slow)
        worker.dispatch()
        await until(lambda: backend.pieces >= 2)
        urgent = Request.new("urgent", "now", priority=Priority.CRITICAL, max_tokens=2)
        take(worker, urgent)
        assert worker.dispatch() == 0  # waits: cancelling the stream would send its text again
        assert worker.stats.preempted == 0
        for task in worker.running.values():
            task.cancel()
        await asyncio.sleep(0.01)

    asyncio.run(run())


class FinalTextBackend(EndlessBackend):
    """A stream whose closing piece carries text and no usage from the server."""

    async def stream(self, request):
        yield Piece(0, "Hello")
        yield Piece(1, ",", "stop", Usage(3, 2, estimated=True))


def test_the_closing_pieces_text_is_the_last_chunk_and_estimated_usage_is_said_so():
    async def run():
        worker = make_worker(FinalTextBackend())
        take(worker, Request.new("t", "hi", max_tokens=5, stream=True))
        worker.dispatch()
        await until(lambda: sent(worker, worker.responses_topic))
        return worker

    worker = asyncio.run(run())
    chunks = [CODEC.decode_chunk(m.value()) for m in sent(worker, worker.settings.topics.chunks)]
    assert [(c.seq, c.delta, c.finish_reason) for c in chunks] == [(0, "Hello", None), (1, ",", "stop")]
    response = CODEC.decode_response(sent(worker, worker.responses_topic)[0].value())
    assert response.output == "Hello," and response.usage_estimated and response.finish_reason == "stop"


def test_exactly_once_chunks_leave_at_once_outside_the_transaction():
    async def run():
        worker = make_worker(delivery="exactly-once")
        worker.session.chunk_producer = chunk_producer = FakeProducer()
        take(worker, Request.new("t", "hi", max_tokens=3, stream=True))
        worker.dispatch()
        await until(lambda: worker.checkpoint.ready)
        return worker, chunk_producer

    worker, chunk_producer = asyncio.run(run())
    assert len(chunk_producer.sent) == 4 and worker.producer.sent == []  # the answer waits for its transaction
    (answer,) = [o for part in worker.checkpoint.ready.values() for held in part.values() for o in held]
    assert answer.topic == worker.responses_topic and answer.partition is ANY_PARTITION
