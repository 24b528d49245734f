"""A copy the gateway dispatched again, taken by a worker that never saw the first: the first
answer read back and given again, byte for byte, instead of running the model a second time.

The reading itself is on a real broker (tests/integration/worker/test_earlier_answers.py); here
the worker's side with the reader stubbed, and the pure scan over records.
"""

from __future__ import annotations

import asyncio

from pipeline.models import DISPATCHED_AGAIN_HEADER, REDELIVERED, RESUBMITTED, Request, Response, Status
from pipeline.testing import FakeMessage
from pipeline.worker.earlier_answers import dispatched_again, first_terminal
from tests.unit.worker.test_preemption import CODEC, make_worker, settle

AGAIN = [(DISPATCHED_AGAIN_HEADER, RESUBMITTED)]
REDELIVERY = [(DISPATCHED_AGAIN_HEADER, REDELIVERED)]


def dispatched(request: Request) -> Request:
    request.admitted_at = request.created_at + 5
    return request


class Reader:
    """Stands in for EarlierAnswers: what a read-back finds, and what it was asked."""

    enabled = True

    def __init__(self, answer: tuple[bytes, bytes] | None):
        self.answer = answer
        self.asked: list = []

    def place(self, topic, partition, key):
        return 0 if partition is None else partition

    def find(self, topic, partition, request_id, since_ms):
        self.asked.append((topic, partition, request_id, since_ms))
        return self.answer

    def close(self):
        pass


def worker_with(reader: Reader, **cfg):
    worker = make_worker(**cfg)
    worker.processor.earlier = worker.ctx.earlier = reader
    return worker


def put(worker, request: Request, offset: int, headers=None) -> tuple:
    tp = (worker.settings.topics.request_topic(request.priority), 0)
    worker.take(FakeMessage(tp[0], 0, offset, CODEC.encode_request(request), request.tenant_id.encode(), headers))
    return tp


def answered_elsewhere(request: Request) -> tuple[bytes, bytes]:
    resp = Response.for_request(request, Status.COMPLETED, output="the first answer", worker_id="another-worker",
                                admitted_at=request.admitted_at, started_at=request.admitted_at + 1,
                                finished_at=request.admitted_at + 2)
    return CODEC.encode_response(resp), request.tenant_id.encode()


def sent(worker) -> list[bytes]:
    return [m.value() for m in worker.producer.sent if m.topic() == worker.responses_topic]


def test_a_copy_dispatched_again_gets_the_answer_another_worker_gave_and_the_model_is_not_called():
    async def run():
        request = dispatched(Request.new("tenant-a", "answered by another worker"))
        first = answered_elsewhere(request)
        reader = Reader(first)
        worker = worker_with(reader, max_inflight=4)
        tp = put(worker, request, 3, AGAIN)
        assert worker.dispatch() == 1
        await settle()
        assert sent(worker) == [first[0]]
        assert worker.backend.calls == []
        assert reader.asked == [(worker.responses_topic, 0, request.request_id, request.admitted_at)]
        assert dict(worker.checkpoint.tracker.to_commit()).get(tp) == 4
        # A later copy is answered from memory, without reading back again.
        put(worker, request, 4, AGAIN)
        worker.dispatch()
        await settle()
        assert sent(worker) == [first[0], first[0]] and len(reader.asked) == 1

    asyncio.run(run())


def test_a_copy_dispatched_again_whose_first_answer_is_not_found_runs():
    async def run():
        request = dispatched(Request.new("tenant-a", "its first copy never went out"))
        worker = worker_with(Reader(None), max_inflight=4)
        put(worker, request, 0, AGAIN)
        worker.dispatch()
        await settle()
        assert worker.backend.calls == [request.request_id]
        worker.backend.release(request.request_id)
        await settle()
        [answer] = [CODEC.decode_response(v) for v in sent(worker)]
        assert answer.status is Status.COMPLETED and answer.worker_id == "preempt-worker"

    asyncio.run(run())


def test_a_first_dispatch_and_a_copy_this_worker_remembers_are_never_read_back():
    async def run():
        reader = Reader(None)
        worker = worker_with(reader, max_inflight=4)
        request = dispatched(Request.new("tenant-a", "first time"))
        put(worker, request, 0)
        worker.dispatch()
        await settle()
        worker.backend.release(request.request_id)
        await settle()
        put(worker, request, 1, AGAIN)  # dispatched again, but this worker answered the first
        worker.dispatch()
        await settle()
        [answer, again] = sent(worker)
        assert again == answer and reader.asked == []

    asyncio.run(run())


def test_the_scan_gives_the_first_terminal_answer_to_the_id_and_passes_over_the_rest():
    request = dispatched(Request.new("tenant-a", "scan"))
    other = dispatched(Request.new("tenant-a", "another id"))
    progress = Response.for_request(request, Status.QUEUED, queue_position=3)
    final = Response.for_request(request, Status.COMPLETED, output="done")
    later = Response.for_request(request, Status.COMPLETED, output="a later repeat")
    key = b"tenant-a"
    records = [(None, key), (b"\xc3\x01 not a response " + request.request_id.encode(), key),
               (CODEC.encode_response(Response.for_request(other, Status.COMPLETED, output="x")), key),
               (CODEC.encode_response(progress), key), (CODEC.encode_response(final), key),
               (CODEC.encode_response(later), key)]
    assert first_terminal(records, request.request_id, CODEC.decode_response) == (CODEC.encode_response(final), key)
    assert first_terminal(records[:4], request.request_id, CODEC.decode_response) is None


def test_exactly_once_a_copy_the_gateway_redelivered_is_not_answered_again_its_first_answer_covers_it():
    async def run():
        request = dispatched(Request.new("tenant-a", "redelivered after a gateway failover"))
        first = answered_elsewhere(request)
        worker = worker_with(Reader(first), max_inflight=4, delivery="exactly-once")
        worker.session.consumer = None  # nothing is committed in this test
        tp = put(worker, request, 3, REDELIVERY)
        worker.dispatch()
        await settle()
        assert worker.backend.calls == [] and worker.checkpoint.ready.get(tp, {}) == {}
        assert dict(worker.checkpoint.tracker.to_commit()).get(tp) == 4  # its offset finishes, unanswered
        # A client's re-submission of the id is answered: it asked again.
        put(worker, request, 4, AGAIN)
        worker.dispatch()
        await settle()
        assert [o.value for o in worker.checkpoint.ready[tp][4]] == [first[0]]
        assert worker.metrics.duplicates.labels("dropped").value == 1

    asyncio.run(run())


def test_only_the_gateways_mark_makes_a_copy_dispatched_again():
    assert dispatched_again(AGAIN) == RESUBMITTED and dispatched_again([("llmq-not-before", b"1"), *REDELIVERY]) == REDELIVERED
    assert dispatched_again(None) is None and dispatched_again([]) is None and dispatched_again([("other", b"")]) is None
    assert dispatched_again([(DISPATCHED_AGAIN_HEADER, None)]) == b""


def test_exactly_once_a_redelivered_copy_of_an_id_this_worker_answered_is_not_answered_again():
    reader = Reader(None)
    worker = worker_with(reader, delivery="exactly-once")
    worker.session.consumer = None
    worker.backend.complete_now = lambda request: worker.backend.answer(request)
    request = dispatched(Request.new("tenant-a", "answered here"))
    tp = put(worker, request, 0)
    worker.dispatch()
    put(worker, request, 1, REDELIVERY)
    worker.dispatch()
    assert list(worker.checkpoint.ready[tp]) == [0] and reader.asked == []
    assert dict(worker.checkpoint.tracker.to_commit()).get(tp) == 2


def test_after_a_read_back_the_broker_could_not_answer_copies_run_without_waiting_for_another():
    from confluent_kafka import KafkaError, KafkaException

    from pipeline.config import Settings
    from pipeline.worker.earlier_answers import EarlierAnswers

    reader = EarlierAnswers(Settings.load(env={}), "w", CODEC.decode_response, lambda topic: 3, 1000)
    scans = []

    def scan(*args):
        scans.append(args)
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT))

    reader._scan = scan
    assert reader.find("llm.responses", 0, "id-1", 0) is None
    assert reader.find("llm.responses", 0, "id-2", 0) is None
    assert len(scans) == 1 and reader.missed == 2
