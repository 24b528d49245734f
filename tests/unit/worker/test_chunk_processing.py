"""A chunk of taken requests is processed stage by stage, but answered as if one by one.

Driven without a broker: the fake producer acknowledges at once and records the order
responses were published in.
"""

from __future__ import annotations

import asyncio

from pipeline.config import Settings
from pipeline.models import Priority, Request, Status, now_ms
from pipeline.serde import Codec
from pipeline.testing import FakeMessage
from pipeline.worker.backends.simulated import SimulatedBackend
from pipeline.worker.loop import Worker
from tests.unit.worker.test_admission_fuzz import LIMITS, FakeProducer

CODEC = Codec.default()


def make_worker(**worker) -> Worker:
    s = Settings.load(env={})
    for name, value in LIMITS.items():
        setattr(s.serde, name, value)
    for name, value in worker.items():
        setattr(s.worker, name, value)
    w = Worker(s, SimulatedBackend(), worker_id="chunk-worker")
    w.session.producer = FakeProducer()
    return w


def _msg(worker, offset: int, req: Request | bytes) -> FakeMessage:
    value = req if isinstance(req, bytes) else CODEC.encode_request(req)
    return FakeMessage(worker.settings.topics.request_topic(Priority.NORMAL), 0, offset, value, b"k")


def _answers(worker) -> list:
    return [(m.topic(), CODEC.decode_response(m.value()) if m.topic() == worker.responses_topic else None)
            for m in worker.producer.sent]


def _take_all(worker, msgs) -> None:
    for m in msgs:
        worker.take(m)


def test_every_message_of_a_chunk_gets_its_one_outcome_whatever_its_kind():
    worker = make_worker()
    first = Request.new("tenant-a", "hello", priority=Priority.NORMAL)
    expired = Request.new("tenant-b", "late", priority=Priority.NORMAL, timeout_ms=1, created_at=now_ms() - 60_000)
    ok = Request.new("tenant-c", "fine", priority=Priority.NORMAL)
    msgs = [_msg(worker, 0, first), _msg(worker, 1, CODEC.encode_request(first)), _msg(worker, 2, expired),
            _msg(worker, 3, b"\x00garbage"), _msg(worker, 4, ok)]
    _take_all(worker, msgs)
    # The undecodable one is dead-lettered when taken; the four others start in one chunk.
    assert [topic for topic, _ in _answers(worker)] == [worker.dlq_topic]
    assert worker.dispatch() == 4
    responses = [r for topic, r in _answers(worker) if r is not None]
    assert sorted((r.request_id, r.status) for r in responses) == sorted([
        (first.request_id, Status.COMPLETED),
        (first.request_id, Status.COMPLETED),  # the copy, answered the same
        (expired.request_id, Status.EXPIRED),
        (ok.request_id, Status.COMPLETED),
    ])
    sent = [m.value() for m in worker.producer.sent if m.topic() == worker.responses_topic]
    copies = [v for v, r in zip(sent, responses) if r.request_id == first.request_id]
    assert copies[0] == copies[1]
    assert [topic for topic, _ in _answers(worker)].count(worker.dlq_topic) == 1
    assert worker.checkpoint.tracker.to_commit() == [((msgs[0].topic(), 0), 5)]  # every offset finished


def test_a_chunk_never_starts_more_backend_calls_than_free_slots():
    worker = make_worker()
    worker.cfg.max_inflight = 3
    started = []

    async def slow(request):
        started.append(request.request_id)
        await asyncio.sleep(60)

    worker.backend.complete_now = lambda request: None
    worker.backend.complete = slow

    async def run():
        _take_all(worker, [_msg(worker, i, Request.new("t", f"p{i}", priority=Priority.NORMAL)) for i in range(10)])
        assert worker.dispatch() == 3
        assert len(worker.running) == 3
        assert worker.dispatch() == 0  # full: the rest wait in the band's queue
        assert worker.scheduler.queues[Priority.NORMAL.rank].size == 7
        for task in worker.running.values():
            task.cancel()
        await asyncio.gather(*worker.running.values(), return_exceptions=True)

    asyncio.run(run())


def test_exactly_once_outcomes_wait_for_the_commit_in_offset_order():
    worker = make_worker(delivery="exactly-once")
    reqs = [Request.new(f"tenant-{i}", "hi", priority=Priority.NORMAL) for i in range(4)]
    _take_all(worker, [_msg(worker, i, r) for i, r in enumerate(reqs)])
    worker.dispatch()
    assert worker.producer.sent == []  # published only inside the commit's transaction
    ready = worker.checkpoint.ready[(worker.settings.topics.request_topic(Priority.NORMAL), 0)]
    assert sorted(ready) == [0, 1, 2, 3]
    assert [CODEC.decode_response(ready[o][0].value).request_id for o in sorted(ready)] == [r.request_id for r in reqs]


def test_a_backend_that_raises_at_once_fails_only_that_request_in_its_place():
    worker = make_worker()
    answer_now = worker.backend.complete_now

    def flaky(request):
        if request.prompt == "boom":
            raise RuntimeError("simulated bug")
        return answer_now(request)

    worker.backend.complete_now = flaky
    reqs = [Request.new("t", p, priority=Priority.NORMAL) for p in ("one", "boom", "three")]
    msgs = [_msg(worker, i, r) for i, r in enumerate(reqs)]
    _take_all(worker, msgs)
    worker.dispatch()
    responses = [r for _, r in _answers(worker)]
    assert [(r.request_id, r.status) for r in responses] == [
        (reqs[0].request_id, Status.COMPLETED), (reqs[1].request_id, Status.FAILED),
        (reqs[2].request_id, Status.COMPLETED)]
    assert responses[1].reason == "backend_error: RuntimeError: simulated bug"
    assert worker.checkpoint.tracker.to_commit() == [((msgs[0].topic(), 0), 3)]


def test_exactly_once_answers_are_held_even_once_the_producer_was_abandoned():
    # A call that ends after its producer was abandoned in a stuck transactional call: its answer
    # waits for a transaction like any other (the restart drops it), nothing raises.
    worker = make_worker(delivery="exactly-once")
    worker.session.producer = None
    req = Request.new("tenant", "late", priority=Priority.NORMAL)
    _take_all(worker, [_msg(worker, 0, req)])
    worker.dispatch()
    assert list(worker.checkpoint.ready[(worker.settings.topics.request_topic(Priority.NORMAL), 0)]) == [0]
