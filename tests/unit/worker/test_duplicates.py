"""A request id seen again never gets a different answer from the first.

While the first submission is in flight (running, or back in its queue after a preemption) a
copy is dropped: its offset finishes without an answer. Once the first is answered, a copy is
given the same bytes again. Driven without a broker, as test_preemption: the backend's calls
wait on events the test releases.
"""

from __future__ import annotations

import asyncio
import dataclasses

from confluent_kafka import TopicPartition

from pipeline.models import Priority, Request, Status
from pipeline.testing import FakeMessage
from pipeline.worker.dedupe import IN_FLIGHT, RecentRequests
from tests.unit.worker.test_preemption import CODEC, make_worker, settle

NORMAL = Priority.NORMAL


def put(worker, request: Request, partition: int, offset: int, band: Priority = NORMAL) -> tuple:
    """``request`` read from ``band``'s topic at ``partition``/``offset``; returns the partition."""
    tp = (worker.settings.topics.request_topic(band), partition)
    worker.take(FakeMessage(tp[0], partition, offset, CODEC.encode_request(request), request.tenant_id.encode()))
    return tp


def sent(worker) -> list[bytes]:
    return [m.value() for m in worker.producer.sent if m.topic() == worker.responses_topic]


class Assigned:
    def assignment(self):
        return []


def test_a_copy_arriving_while_the_first_runs_is_dropped_and_its_offset_finishes():
    async def run():
        worker = make_worker(max_inflight=4)
        request = Request.new("tenant-a", "once")
        first = put(worker, request, 0, 0)
        assert worker.dispatch() == 1
        await settle()
        copy = put(worker, request, 1, 0)
        worker.dispatch()
        await settle()
        assert worker.backend.calls == [request.request_id]  # the copy never reached the model
        assert sent(worker) == []  # nor answered REJECTED while the first still runs
        positions = dict(worker.checkpoint.tracker.to_commit())
        assert positions.get(copy) == 1 and first not in positions
        worker.backend.release(request.request_id)
        await settle()
        assert [CODEC.decode_response(v).status for v in sent(worker)] == [Status.COMPLETED]
        assert dict(worker.checkpoint.tracker.to_commit()).get(first) == 1
        assert worker.stats.duplicates == 1
        assert worker.metrics.duplicates.labels("dropped").value == 1

    asyncio.run(run())


def test_a_copy_arriving_after_the_first_was_answered_gets_the_same_bytes():
    async def run():
        worker = make_worker(max_inflight=4)
        request = Request.new("tenant-a", "once")
        put(worker, request, 0, 0)
        worker.dispatch()
        await settle()
        worker.backend.release(request.request_id)
        await settle()
        copy = put(worker, request, 0, 1)
        assert worker.dispatch() == 1
        [answer, again] = sent(worker)
        assert again == answer
        assert worker.backend.calls == [request.request_id]
        assert dict(worker.checkpoint.tracker.to_commit()).get(copy) == 2
        assert worker.metrics.duplicates.labels("repeated").value == 1

    asyncio.run(run())


def test_a_copy_arriving_while_the_first_is_preempted_waits_for_its_one_answer():
    async def run():
        worker = make_worker(max_inflight=1)
        backend = worker.backend
        background = Request.new("tenant-a", "slow", priority=Priority.BACKGROUND)
        put(worker, background, 0, 0, Priority.BACKGROUND)
        worker.dispatch()
        await settle()
        urgent = Request.new("tenant-b", "now", priority=Priority.CRITICAL)
        put(worker, urgent, 0, 0, Priority.CRITICAL)
        assert worker.dispatch() == 1  # the BACKGROUND call gave way, its message queued again
        await settle()
        assert backend.cancelled == [background.request_id]
        # A copy in a higher band (re-admitted elsewhere), taken while the first waits in its queue.
        copy = put(worker, background, 0, 0, Priority.HIGH)
        backend.release(urgent.request_id)
        await settle()
        assert worker.dispatch() == 2  # the copy, dropped at once; then the first, again
        await settle()
        assert dict(worker.checkpoint.tracker.to_commit()).get(copy) == 1
        backend.release(background.request_id)
        await settle()
        answers = [CODEC.decode_response(v) for v in sent(worker)]
        assert [r.request_id for r in answers] == [urgent.request_id, background.request_id]
        assert backend.calls.count(background.request_id) == 2  # its first run, and its run after preemption
        assert not worker.running

    asyncio.run(run())


def test_another_tenants_request_with_a_taken_id_is_refused_not_given_the_first_answer():
    worker = make_worker()
    worker.backend.complete_now = lambda request: worker.backend.answer(request)
    request = Request.new("tenant-a", "mine")
    put(worker, request, 0, 0)
    worker.dispatch()
    put(worker, dataclasses.replace(request, tenant_id="tenant-b"), 1, 0)
    worker.dispatch()
    first, other = (CODEC.decode_response(v) for v in sent(worker))
    assert first.status is Status.COMPLETED and first.tenant_id == "tenant-a"
    assert other.status is Status.REJECTED and other.tenant_id == "tenant-b" and other.output is None
    assert other.reason.startswith("duplicate_request_id")


def test_a_redelivered_request_of_a_lost_partition_is_answered_the_same_again():
    # Answered, but the partition was lost before the commit: it comes back with that offset.
    worker = make_worker()
    worker.session.consumer = Assigned()
    worker.backend.complete_now = lambda request: worker.backend.answer(request)
    request = Request.new("tenant-a", "answered before the loss")
    tp = put(worker, request, 0, 0)
    worker.dispatch()
    worker.on_lost(worker.consumer, [TopicPartition(*tp)])
    put(worker, request, 0, 0)
    worker.dispatch()
    [answer, again] = sent(worker)
    assert again == answer
    assert worker.checkpoint.tracker.to_commit() == [(tp, 1)]


def test_revoking_one_partition_keeps_the_copies_of_anothers_running_request_out():
    async def run():
        worker = make_worker(max_inflight=4)
        worker.session.consumer = Assigned()
        request = Request.new("tenant-a", "long")
        put(worker, request, 0, 0)
        worker.dispatch()
        await settle()
        other = worker.settings.topics.request_topic(Priority.LOW)
        worker.session.restart = True  # nothing to commit in this test
        worker.on_revoke(worker.consumer, [TopicPartition(other, 3)])
        put(worker, request, 1, 0)
        worker.dispatch()
        await settle()
        assert worker.backend.calls == [request.request_id]
        for task in worker.running.values():
            task.cancel()
        await settle()

    asyncio.run(run())


def test_exactly_once_a_redelivered_offset_runs_as_new_and_a_resubmitted_id_gets_the_same_bytes():
    worker = make_worker(delivery="exactly-once")
    worker.session.consumer = Assigned()
    worker.backend.complete_now = lambda request: worker.backend.answer(request)
    request = Request.new("tenant-a", "in a transaction")
    tp = put(worker, request, 0, 0)
    worker.dispatch()
    assert list(worker.checkpoint.ready[tp]) == [0]
    # revoked before its transaction: the answer is dropped, never published
    worker.session.restart = True
    worker.on_revoke(worker.consumer, [TopicPartition(*tp)])
    worker.session.restart = False
    put(worker, request, 0, 0)  # back, the same offset: not a copy, it runs
    worker.dispatch()
    assert worker.stats.duplicates == 0 and worker.stats.completed == 2
    [answer] = worker.checkpoint.ready[tp][0]  # (its one outcome: no receipt)
    other = put(worker, request, 1, 5)  # re-submitted: a copy, given the same bytes
    worker.dispatch()
    assert [o.value for o in worker.checkpoint.ready[other][5]] == [answer.value]
    assert worker.stats.completed == 2 and worker.stats.duplicates == 1


def test_a_dedupe_window_of_zero_runs_every_copy():
    worker = make_worker(dedupe_window=0)
    worker.backend.complete_now = lambda request: worker.backend.answer(request)
    request = Request.new("tenant-a", "twice")
    put(worker, request, 0, 0)
    put(worker, request, 0, 1)
    worker.dispatch()
    assert worker.stats.completed == 2 and worker.stats.duplicates == 0


# -- RecentRequests itself --------------------------------------------------------------------------


def test_recent_requests_tell_a_rerun_from_a_copy_and_forget_the_oldest_answers():
    recent = RecentRequests(window=2)
    a = (("t", 0), 1)
    assert recent.check("x", a) is None
    assert recent.check("x", a) is None  # the same message again (preempted): it runs
    assert recent.check("x", (("t", 1), 7)) is IN_FLIGHT
    recent.answered("x", a, b"answer-x", b"tenant")
    assert recent.check("x", (("t", 1), 7)) == (b"answer-x", b"tenant")
    for rid in ("y", "z"):
        recent.check(rid, (("t", 0), 2))
        recent.answered(rid, (("t", 0), 2), b"answer", b"tenant")
    assert recent.check("x", (("t", 1), 8)) is None  # pushed out: taken again
    assert len(recent) == 3  # y and z answered, x running


def test_recent_requests_release_a_partitions_running_ids_and_forget_unpublished_answers():
    recent = RecentRequests(window=10, exactly_once=True)
    p0, p1 = ("t", 0), ("t", 1)
    recent.check("a", (p0, 1))
    recent.check("b", (p1, 1))
    recent.release({p0})
    assert recent.check("a", (p1, 2)) is None  # handed back: no longer in flight here
    assert recent.check("b", (p0, 3)) is IN_FLIGHT
    recent.answered("b", (p1, 1), b"b", b"k")
    recent.forget_answers({(p1, 1)})
    assert recent.answer_of("b") is None
