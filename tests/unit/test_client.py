"""The client's response correlation, without a broker: QUEUED events never resolve a wait."""

from __future__ import annotations

import threading

import pytest

from pipeline.client import LlmqClient, Correlator
from pipeline.config import Settings
from pipeline.errors import LlmqError, RequestTimeoutError
from pipeline.models import Request, Response, Status


def _queued(req: Request, position: int) -> Response:
    return Response.for_request(req, Status.QUEUED, queue_position=position, eta_ms=100 * position)


def test_queued_does_not_resolve_the_future_but_is_observable():
    c = Correlator()
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
    c = Correlator()
    req = Request.new("t", "p")
    fut = c.expect(req.request_id)
    done = Response.for_request(req, Status.EXPIRED)
    c.deliver(done)
    c.deliver(_queued(req, 1))  # late (redelivered) progress event
    assert fut.result(0) is done and c.queued(req.request_id) is None


def test_every_terminal_status_resolves():
    c = Correlator()
    for status in Status:
        req = Request.new("t", "p")
        fut = c.expect(req.request_id)
        c.deliver(Response.for_request(req, status))
        assert fut.done() is status.is_terminal


def test_queued_is_not_kept_as_an_early_response():
    c = Correlator(early_max=2)
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
    c = Correlator()
    req = Request.new("t", "p")
    fut = c.expect(req.request_id)
    first = Response.for_request(req, Status.COMPLETED, output="one")
    c.deliver(first)
    c.deliver(Response.for_request(req, Status.COMPLETED, output="two"))
    assert fut.result(0) is first


def test_forget_drops_the_waiter_and_its_queued_event():
    c = Correlator()
    req = Request.new("t", "p")
    c.expect(req.request_id)
    c.deliver(_queued(req, 3))
    c.forget(req.request_id)
    assert c.queued(req.request_id) is None


def test_fail_all_fails_pending_waiters_only():
    c = Correlator()
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
    correlator = client.engine.correlator
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
    client.engine.correlator.deliver(_queued(req, 0))
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
    from pipeline.client import ClientEngine

    engine = ClientEngine.__new__(ClientEngine)
    engine.correlator = correlator
    return engine


def test_a_listener_behind_the_high_watermark_with_someone_waiting_is_reassigned_at_its_position():
    correlator = Correlator()
    correlator.expect("waiting-id")
    consumer = _StuckConsumer(position=40, high=45)
    _engine_with(correlator).unstick(consumer)
    assert consumer.reassigned == [[("llm.responses", 0, 40)]]


def test_an_idle_listener_with_nothing_to_read_or_nobody_waiting_is_left_alone():
    waiting = Correlator()
    waiting.expect("id")
    caught_up = _StuckConsumer(position=45, high=45)
    _engine_with(waiting).unstick(caught_up)
    behind = _StuckConsumer(position=40, high=45)
    _engine_with(Correlator()).unstick(behind)
    assert caught_up.reassigned == [] and behind.reassigned == []


# -- replies to their owner: reply partitions, the gateway's first word, streams --------------------

from pipeline.client import Submitted, LoopWaker, StreamState  # noqa: E402
from pipeline.models import Chunk, Priority  # noqa: E402
from pipeline.serde import Codec  # noqa: E402
from pipeline.tenants.signing import verify  # noqa: E402


def test_requests_name_the_clients_reply_partitions_in_turn_unless_they_name_their_own():
    c = LlmqClient(Settings.load(env={}), listen=False, reply_partitions=[4, 2])
    try:
        parts = [c.engine.addressed(Request.new("t", "p")).reply_partition for _ in range(4)]
        assert sorted(set(parts)) == [2, 4] and parts[0] != parts[1]
        own = Request.new("t", "p", reply_partition=1)
        assert c.engine.addressed(own) is own
        assert c.reply_partitions == [2, 4]
    finally:
        c.close()


def test_a_reply_topic_of_its_own_is_named_in_every_request():
    c = LlmqClient(Settings.load(env={}), listen=False, reply_partitions=[0], reply_to="llm.replies.acme")
    try:
        req = c.engine.addressed(Request.new("acme", "p"))
        assert req.reply_to == "llm.replies.acme" and req.reply_partition == 0
    finally:
        c.close()


def test_the_first_word_is_the_first_queued_event_or_the_answer():
    c = Correlator()
    queued, refused = Request.new("t", "a", notify_queued=True), Request.new("t", "b", notify_queued=True)
    c.expect(queued.request_id)
    first_q, first_r = c.first_word(queued.request_id), c.first_word(refused.request_id)
    c.deliver(_queued(queued, 7))
    c.deliver(_queued(queued, 3))
    assert first_q.result(0).queue_position == 7
    c.deliver(Response.for_request(refused, Status.REJECTED, reason="rate_limited: x"))
    assert first_r.result(0).status is Status.REJECTED


def test_submitted_tells_what_the_gateway_said():
    req = Request.new("t", "p", notify_queued=True)
    word = _queued(req, 5)
    sub = Submitted(req.request_id, "topic", 0, 9, word)
    assert sub.status is Status.QUEUED and sub.queue_position == 5 and sub.eta_ms == 500
    assert Submitted(req.request_id, "topic", 0, 9).status is None


def _chunk(req, seq, delta, last=False):
    return Chunk.for_request(req, seq, delta, finish_reason="stop" if last else None)


def test_a_stream_hands_out_chunks_in_order_each_once_and_ends_at_the_last():
    req = Request.new("t", "p")
    s = StreamState(req)
    assert s.feed(_chunk(req, 1, "b")) == []  # waits for 0
    assert [c.delta for c in s.feed(_chunk(req, 0, "a"))] == ["a", "b"]
    assert s.feed(_chunk(req, 0, "a")) == [] and s.feed(_chunk(req, 1, "b")) == []  # copies
    assert [c.delta for c in s.feed(_chunk(req, 2, "c", last=True))] == ["c"] and s.ended
    assert s.feed(_chunk(req, 3, "late")) == []


def test_a_stream_ends_early_on_a_refusal_and_settles_a_completed_answer_it_did_not_fully_see():
    req = Request.new("t", "p")
    refused = StreamState(req)
    refused.feed(Response.for_request(req, Status.REJECTED, reason="rate_limited: x"))
    assert refused.ended and not refused.answered
    partial = StreamState(req)
    partial.feed(_chunk(req, 0, "hel"))
    partial.feed(Response.for_request(req, Status.COMPLETED, output="hello", finish_reason="length"))
    assert partial.answered and not partial.ended
    [rest] = partial.settle()
    assert (rest.delta, rest.seq, rest.finish_reason) == ("lo", 1, "length") and partial.ended


def test_the_loop_waker_wakes_the_loop_once_per_batch():
    import asyncio

    async def go():
        loop = asyncio.get_running_loop()
        waker = LoopWaker(loop)
        got: list = []
        calls = []
        original = loop.call_soon_threadsafe

        def counting(*args):
            calls.append(1)
            return original(*args)

        loop.call_soon_threadsafe = counting
        thread = threading.Thread(target=lambda: [waker.push(got.append, i) for i in range(100)])
        thread.start()
        thread.join()
        await asyncio.sleep(0.01)
        loop.call_soon_threadsafe = original
        return got, len(calls)

    got, wakeups = asyncio.run(go())
    assert got == list(range(100)) and wakeups == 1


class _Producer:
    def __init__(self):
        self.produced = []

    def produce(self, topic, value, key, headers=None, on_delivery=None):
        self.produced.append((topic, value, key, headers))

    def poll(self, timeout):
        return 0

    def flush(self, timeout=None):
        return 0


def test_requests_of_tenants_with_a_secret_are_signed_over_their_bytes():
    c = LlmqClient(Settings.load(env={}), listen=False, signing_secret={"acme": b"s3cret"})
    real = c.engine.producer
    try:
        c.engine.producer = fake = _Producer()
        c.engine.submit_future(Request.new("acme", "signed", priority=Priority.HIGH))
        c.engine.submit_future(Request.new("other", "unsigned"))
        (topic, value, key, headers), (_, _, _, none) = fake.produced
        [(name, sig)] = headers
        assert topic.endswith(".requests.high") and key == b"acme" and name == "llmq-signature"
        assert verify(b"s3cret", value, sig.decode()) and none is None
        assert Codec.default().decode_request(value).tenant_id == "acme"
    finally:
        c.engine.producer = real
        c.close()


def test_a_settled_stream_hands_out_what_came_past_a_gap_before_the_rest_of_the_answer():
    req = Request.new("t", "p")
    s = StreamState(req)
    assert [c.delta for c in s.feed(_chunk(req, 0, "a"))] == ["a"]
    assert s.feed(_chunk(req, 2, "c")) == []  # chunk 1 was lost
    s.feed(Response.for_request(req, Status.COMPLETED, output="abcd"))
    settled = s.settle()
    assert [(c.seq, c.delta) for c in settled] == [(2, "c"), (3, "")] and settled[-1].last


def test_a_delivery_after_the_caller_gave_up_does_not_stop_the_client():
    """An asyncio caller's timeout cancels the future it awaited; its late delivery report must
    be dropped, not raise in the thread that polls the producer (which then delivered nothing)."""
    from concurrent.futures import Future

    from pipeline.client import _settle

    cancelled = Future()
    cancelled.cancel()
    _settle(cancelled, "late")
    _settle(cancelled, error=RuntimeError("late"))
    done = Future()
    _settle(done, "first")
    _settle(done, "second")
    assert done.result() == "first"
