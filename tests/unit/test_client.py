"""The client's response correlation, without a broker: QUEUED events never resolve a wait."""

from __future__ import annotations

import threading

import pytest

from pipeline.client import LlmqClient, _Correlator
from pipeline.config import Settings
from pipeline.errors import LlmqError, RequestTimeoutError
from pipeline.models import Request, Response, Status


def _queued(req: Request, position: int) -> Response:
    return Response.for_request(req, Status.QUEUED, queue_position=position, eta_ms=100 * position)


def test_queued_does_not_resolve_the_future_but_is_observable():
    c = _Correlator()
    req = Request.new("t", "p", notify_queued=True)
    fut = c.expect(req.request_id)
    assert c.queued(req.request_id) is None
    c.deliver(_queued(req, 5))
    c.deliver(_queued(req, 2))
    assert not fut.done()
    assert c.queued(req.request_id).queue_position == 2  # the latest one
    done = Response.for_request(req, Status.COMPLETED, output="hi")
    c.deliver(done)
    assert fut.result(0) is done
    assert c.queued(req.request_id) is None  # answered: no longer queued


def test_queued_after_the_answer_changes_nothing():
    c = _Correlator()
    req = Request.new("t", "p")
    fut = c.expect(req.request_id)
    done = Response.for_request(req, Status.EXPIRED)
    c.deliver(done)
    c.deliver(_queued(req, 1))  # late (redelivered) progress event
    assert fut.result(0) is done and c.queued(req.request_id) is None


def test_every_terminal_status_resolves():
    c = _Correlator()
    for status in Status:
        req = Request.new("t", "p")
        fut = c.expect(req.request_id)
        c.deliver(Response.for_request(req, status))
        assert fut.done() is status.is_terminal


def test_queued_is_not_kept_as_an_early_response():
    c = _Correlator(early_max=2)
    answered = [Request.new("t", str(i)) for i in range(2)]
    for req in answered:
        c.deliver(Response.for_request(req, Status.COMPLETED))
    # Progress events of requests nobody waits for are dropped, not buffered...
    for i in range(10):
        c.deliver(_queued(Request.new("t", "other"), i))
    # ...so they never push a real answer out of the early buffer, nor stand in for one.
    for req in answered:
        assert c.expect(req.request_id).result(0).status is Status.COMPLETED
    late = Request.new("t", "late")
    c.deliver(_queued(late, 0))
    fut = c.expect(late.request_id)
    assert not fut.done() and c.queued(late.request_id) is None


def test_duplicates_after_the_first_terminal_response_are_ignored():
    c = _Correlator()
    req = Request.new("t", "p")
    fut = c.expect(req.request_id)
    first = Response.for_request(req, Status.COMPLETED, output="one")
    c.deliver(first)
    c.deliver(Response.for_request(req, Status.COMPLETED, output="two"))
    assert fut.result(0) is first


def test_forget_drops_the_waiter_and_its_queued_event():
    c = _Correlator()
    req = Request.new("t", "p")
    c.expect(req.request_id)
    c.deliver(_queued(req, 3))
    c.forget(req.request_id)
    assert c.queued(req.request_id) is None


def test_fail_all_fails_pending_waiters_only():
    c = _Correlator()
    a, b = Request.new("t", "a"), Request.new("t", "b")
    fa, fb = c.expect(a.request_id), c.expect(b.request_id)
    c.deliver(Response.for_request(a, Status.COMPLETED))
    c.fail_all(LlmqError("listener died"))
    assert fa.result(0).status is Status.COMPLETED
    with pytest.raises(LlmqError):
        fb.result(0)


@pytest.fixture
def client():
    # No listener: responses are handed to the correlator the way the listener would.
    # Creating the producer needs no broker (librdkafka connects lazily).
    c = LlmqClient(Settings.load(env={}), listen=False)
    yield c
    c.close()


def test_result_waits_through_queued_events(client):
    req = Request.new("t", "p", notify_queued=True)
    fut = client.response_future(req.request_id)
    correlator = client._engine.correlator
    answer = Response.for_request(req, Status.COMPLETED, output="done")
    seen: list[int | None] = []

    def listener():
        correlator.deliver(_queued(req, 1))
        seen.append(client.queued(req.request_id).queue_position)
        correlator.deliver(answer)

    thread = threading.Thread(target=listener)
    thread.start()
    assert client.result(req.request_id, timeout=5) is answer
    thread.join()
    assert fut.done() and seen == [1]
    assert client.queued(req.request_id) is None  # result() forgets the request


def test_result_times_out_on_queued_alone(client):
    req = Request.new("t", "p", notify_queued=True)
    client.response_future(req.request_id)
    client._engine.correlator.deliver(_queued(req, 0))
    with pytest.raises(RequestTimeoutError):
        client.result(req.request_id, timeout=0.05)


# -- the response listener's guard against a consumer that stopped fetching (librdkafka#5153) --

class _StuckConsumer:
    def __init__(self, position: int, high: int):
        from confluent_kafka import TopicPartition

        self.tp = TopicPartition("llm.responses", 0, position)
        self.high = high
        self.reassigned = []

    def assignment(self):
        return [self.tp]

    def position(self, parts):
        return list(parts)

    def get_watermark_offsets(self, tp, timeout=None, cached=False):
        return 0, self.high

    def assign(self, parts):
        self.reassigned.append([(p.topic, p.partition, p.offset) for p in parts])


def _engine_with(correlator):
    from pipeline.client import _Engine

    engine = _Engine.__new__(_Engine)
    engine.correlator = correlator
    return engine


def test_a_listener_behind_the_high_watermark_with_someone_waiting_is_reassigned_at_its_position():
    correlator = _Correlator()
    correlator.expect("waiting-id")
    consumer = _StuckConsumer(position=40, high=45)
    _engine_with(correlator)._unstick(consumer)
    assert consumer.reassigned == [[("llm.responses", 0, 40)]]


def test_an_idle_listener_with_nothing_to_read_or_nobody_waiting_is_left_alone():
    waiting = _Correlator()
    waiting.expect("id")
    caught_up = _StuckConsumer(position=45, high=45)
    _engine_with(waiting)._unstick(caught_up)
    behind = _StuckConsumer(position=40, high=45)
    _engine_with(_Correlator())._unstick(behind)
    assert caught_up.reassigned == [] and behind.reassigned == []
