"""What a worker keeps across rebalances: pause flags agree with librdkafka's, and nothing of a
partition it lost is published later."""

from __future__ import annotations

from confluent_kafka import TopicPartition

from pipeline.config import Settings
from pipeline.models import Priority
from pipeline.worker.backends.simulated import SimulatedBackend
from pipeline.worker.loop import Worker


class RememberingConsumer:
    """Keeps pause flags per partition across assignments, as librdkafka does."""

    def __init__(self):
        self.assigned: list[TopicPartition] = []
        self.paused: set[tuple[str, int]] = set()

    def assignment(self):
        return list(self.assigned)

    def pause(self, parts):
        self.paused |= {(tp.topic, tp.partition) for tp in parts}

    def resume(self, parts):
        self.paused -= {(tp.topic, tp.partition) for tp in parts}


def _worker(**worker_settings):
    settings = Settings.load(env={})
    for k, v in worker_settings.items():
        setattr(settings.worker, k, v)
    worker = Worker(settings, SimulatedBackend(), worker_id="pause-test")
    worker.session.consumer = RememberingConsumer()
    return worker


def test_a_partition_that_comes_back_after_it_was_resumed_is_resumed():
    worker = _worker()
    low = worker.settings.topics.request_topic(Priority.LOW)
    tp = TopicPartition(low, 0)
    worker.consumer.assigned = [tp]
    worker.flow.set_paused((low, 0), True)
    assert worker.consumer.paused == {(low, 0)}
    # lost in a rebalance; meanwhile its queue drained and it was resumed
    worker.consumer.assigned = []
    worker.flow.set_paused((low, 0), False)
    # assigned again: librdkafka still has it paused
    worker.consumer.assigned = [tp]
    worker.flow.reapply()
    assert worker.consumer.paused == set()


def test_a_partition_paused_for_its_full_queue_is_paused_again_when_assigned():
    worker = _worker()
    bg = worker.settings.topics.request_topic(Priority.BACKGROUND)
    crit = worker.settings.topics.request_topic(Priority.CRITICAL)
    worker.flow.paused_parts.add((bg, 1))
    worker.consumer.assigned = [TopicPartition(bg, 1), TopicPartition(crit, 1)]
    worker.flow.reapply()
    assert worker.consumer.paused == {(bg, 1)}


def test_exactly_once_outcomes_of_a_lost_or_revoked_partition_are_dropped_not_published_later():
    worker = _worker(delivery="exactly-once")
    topic = worker.settings.topics.request_topic(Priority.NORMAL)
    lost, revoked = (topic, 0), (topic, 1)
    for tp in (lost, revoked):
        worker.checkpoint.tracker.started(tp, 10)
        worker.checkpoint.tracker.started(tp, 11)
        # offset 11 finished before 10: held back, not yet in any transaction
        worker.responder.emit(tp, 11, worker.responses_topic, b"answer", b"tenant", None)
    assert set(worker.checkpoint.ready) == {lost, revoked}
    worker.on_lost(worker.consumer, [TopicPartition(*lost)])
    worker.session.restart = True  # no transaction in this test: the revoke path commits nothing
    worker.on_revoke(worker.consumer, [TopicPartition(*revoked)])
    assert worker.checkpoint.ready == {}


_VALUE = None


def _value():
    global _VALUE
    if _VALUE is None:
        from pipeline.models import Request
        from pipeline.serde import Codec

        _VALUE = Codec.default().encode_request(Request.new("t", "deep", priority=Priority.BACKGROUND))
    return _VALUE


class FakeMessage:
    def __init__(self, topic, partition, offset):
        self._tp, self._offset = (topic, partition), offset

    def error(self):
        return None

    def value(self):
        return _value()

    def headers(self):
        return None

    def topic(self):
        return self._tp[0]

    def partition(self):
        return self._tp[1]

    def offset(self):
        return self._offset


def _take_a_deep_fetch(worker, topic):
    worker.scheduler.cap = 64  # worker.lookahead_requests, small for the test
    worker.consumer.assigned = [TopicPartition(topic, 0)]
    for offset in range(worker.scheduler.cap + 10):
        worker.take(FakeMessage(topic, 0, offset))
    return worker.scheduler.queues[Priority.BACKGROUND.rank]


def test_a_partition_whose_deep_fetch_is_started_at_once_stays_unpaused():
    # pausing it would make librdkafka drop the rest of its prefetched messages and fetch them again
    worker = _worker()
    topic = worker.settings.topics.request_topic(Priority.BACKGROUND)
    queue = _take_a_deep_fetch(worker, topic)
    while queue:
        queue.pop(float("inf"))  # what dispatch does when the backend answers at once
    worker.flow.pause_deep()
    assert worker.consumer.paused == set()


def test_a_partition_whose_queue_is_still_full_after_dispatch_is_paused_and_resumed_at_half():
    worker = _worker()
    topic = worker.settings.topics.request_topic(Priority.BACKGROUND)
    queue = _take_a_deep_fetch(worker, topic)
    worker.flow.pause_deep()
    assert worker.consumer.paused == {(topic, 0)}
    while len(queue) > worker.scheduler.cap // 2:
        queue.pop(float("inf"))
    worker.flow.resume_drained()
    assert worker.consumer.paused == set()


def test_a_lost_partition_that_comes_back_runs_its_uncommitted_requests_again():
    # A worker frozen past its session (SIGSTOP, a long call) loses its partitions; when they
    # come back, the requests it had taken are redelivered and must run, not be taken for copies.
    import asyncio

    from pipeline.models import Status
    from pipeline.testing import FakeMessage as Message
    from tests.unit.worker.test_preemption import CODEC, Feed, answers, make_worker, settle

    async def run():
        worker = make_worker(max_inflight=2)
        worker.session.consumer = RememberingConsumer()
        feed = Feed(worker)
        request = feed.take(Priority.NORMAL)
        assert worker.dispatch() == 1
        await settle()
        tp = (worker.settings.topics.request_topic(Priority.NORMAL), 0)
        worker.on_lost(worker.consumer, [TopicPartition(*tp)])
        await settle()
        assert not worker.running and answers(worker) == []  # handed back, uncommitted
        # assigned again: the same message is read again
        worker.take(Message(tp[0], 0, 0, CODEC.encode_request(request), request.tenant_id.encode()))
        assert worker.dispatch() == 1
        worker.backend.release(request.request_id)
        await settle()
        assert [(r.request_id, r.status) for r in answers(worker)] == [(request.request_id, Status.COMPLETED)]
        assert worker.checkpoint.tracker.to_commit() == [(tp, 1)]

    asyncio.run(run())


def test_the_bytes_read_ahead_are_bounded_over_every_partition():
    worker = _worker()
    topic = worker.settings.topics.request_topic(Priority.BACKGROUND)
    worker.consumer.assigned = [TopicPartition(topic, p) for p in range(3)]
    worker.scheduler.cap_bytes = 20 * (len(_value()) + 1024)  # worker.lookahead_bytes: 20 requests' worth
    offsets = {}
    for i in range(30):
        p = i % 3
        offsets[p] = offsets.get(p, -1) + 1
        worker.take(FakeMessage(topic, p, offsets[p]))
    worker.flow.pause_deep()
    assert worker.consumer.paused  # the partitions that kept coming past the bound
    queue = worker.scheduler.queues[Priority.BACKGROUND.rank]
    while queue.size > 10:
        queue.pop(float("inf"))
    worker.flow.resume_drained()
    assert worker.consumer.paused == set()
