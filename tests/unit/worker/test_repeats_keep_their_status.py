"""A record another worker may have answered is not answered EXPIRED or CANCELLED before its first
answer is looked for: a re-seen id never gets a second, different status.

The reading itself is on a real broker (tests/integration/worker/test_repeats_keep_their_status.py,
where a worker is SIGKILLed between answering and committing); here the rule, and the worker's
side with the reader stubbed.
"""

from __future__ import annotations

import asyncio

from pipeline.cancellations import CancellationView
from pipeline.models import Request, Status, now_ms
from pipeline.testing import FakeMessage
from pipeline.worker import read_back as read_back_module
from pipeline.worker.earlier_answers import CLOCK_SKEW_MS, UNREADABLE, first_terminals, may_be_answered
from tests.unit.worker.test_earlier_answers import AGAIN, REDELIVERY, answered_elsewhere, dispatched, sent
from tests.unit.worker.test_earlier_answers import Reader as AnyReader
from tests.unit.worker.test_earlier_answers import worker_with
from tests.unit.worker.test_preemption import CODEC

CREATE_TIME = 1


class Reader(AnyReader):
    """The stub reader, asked for the first answers to many ids at once too: each found (its
    answer, for any id; None: none found)."""

    def __init__(self, answer):
        super().__init__(answer)
        self.asked_many: list = []

    def find_many(self, topic, partition, wanted):
        self.asked_many.append((topic, partition, dict(wanted)))
        return {} if self.answer is None else dict.fromkeys(wanted, self.answer)


def test_a_record_may_be_answered_when_dispatched_again_or_written_before_its_partition_came_here():
    assigned = 1_000_000
    assert may_be_answered(AGAIN, (CREATE_TIME, assigned + 60_000), assigned)
    assert may_be_answered(REDELIVERY, None, None)  # exactly-once too: the gateway says so
    assert may_be_answered(None, (CREATE_TIME, assigned - 1), assigned)
    # The gateway's clock may run behind this host's: the skew counts as before.
    assert may_be_answered(None, (CREATE_TIME, assigned + CLOCK_SKEW_MS - 1), assigned)
    assert not may_be_answered(None, (CREATE_TIME, assigned + CLOCK_SKEW_MS), assigned)
    assert may_be_answered([], (0, -1), assigned)  # no timestamp: it may be old
    # No previous owner to ask about (driven without a broker, or exactly-once).
    assert not may_be_answered(None, (CREATE_TIME, 0), None)


def _expired(prompt: str) -> Request:
    request = Request.new("tenant-a", prompt, timeout_ms=1_000)
    request.created_at -= 60_000
    return dispatched(request)


def _put(worker, request: Request, offset: int, written_ms: int, headers=None) -> tuple:
    tp = (worker.settings.topics.request_topic(request.priority), 0)
    worker.take(FakeMessage(tp[0], 0, offset, CODEC.encode_request(request), request.tenant_id.encode(), headers,
                            timestamp_ms=written_ms))
    return tp


async def _until(condition, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "not within the time"
        await asyncio.sleep(0.01)


def _statuses(worker) -> list[str]:
    return [CODEC.decode_response(v).status.value for v in sent(worker)]


def test_an_inherited_record_past_its_deadline_gets_its_first_answer_again_not_expired():
    async def run():
        request = _expired("answered by the partition's previous owner, which died before committing")
        first = answered_elsewhere(request)
        reader = Reader(first)
        worker = worker_with(reader, max_inflight=4)
        tp = (worker.settings.topics.request_topic(request.priority), 0)
        worker.processor.read_back.assigned([tp])
        _put(worker, request, 7, written_ms=now_ms() - 30_000)
        worker.dispatch()
        await _until(lambda: sent(worker))
        assert sent(worker) == [first[0]] and worker.stats.expired == 0
        assert worker.backend.calls == [] and len(reader.asked_many) == 1 and reader.asked == []
        await _until(lambda: not worker.processor.tasks)
        assert dict(worker.checkpoint.tracker.to_commit()).get(tp) == 8  # committable once answered

    asyncio.run(run())


def test_an_inherited_record_past_its_deadline_with_no_first_answer_is_expired():
    async def run():
        request = _expired("taken by nobody before")
        worker = worker_with(Reader(None), max_inflight=4)
        tp = (worker.settings.topics.request_topic(request.priority), 0)
        worker.processor.read_back.assigned([tp])
        _put(worker, request, 0, written_ms=now_ms() - 30_000)
        worker.dispatch()
        await _until(lambda: sent(worker))
        assert _statuses(worker) == ["EXPIRED"]

    asyncio.run(run())


def test_a_record_written_after_its_partition_came_here_expires_without_a_read_back():
    # The steady state: no read-back, the answer given in the same pass as the others.
    request = _expired("written long after the assignment")
    reader = Reader(None)
    worker = worker_with(reader, max_inflight=4)
    tp = (worker.settings.topics.request_topic(request.priority), 0)
    worker.processor.read_back.assigned([tp])
    worker.processor.read_back.assigned_at[tp] -= 10 * CLOCK_SKEW_MS
    _put(worker, request, 0, written_ms=now_ms())
    worker.dispatch()  # no event loop needed: nothing runs as a task
    assert _statuses(worker) == ["EXPIRED"] and reader.asked == [] and reader.asked_many == []


def test_a_copy_dispatched_again_and_cancelled_gets_its_first_answer_again_not_cancelled():
    async def run():
        request = dispatched(Request.new("tenant-a", "withdrawn by serve after its first answer"))
        first = answered_elsewhere(request)
        worker = worker_with(Reader(first), max_inflight=4)
        view = CancellationView.__new__(CancellationView)
        view._ids = {request.request_id: "not written to Kafka in time"}
        worker.session.cancellations = view
        _put(worker, request, 0, written_ms=now_ms(), headers=REDELIVERY)
        worker.dispatch()
        await _until(lambda: sent(worker))
        assert sent(worker) == [first[0]] and worker.stats.cancelled == 0

    asyncio.run(run())


def test_a_read_back_the_broker_cannot_answer_is_asked_again_before_answering(monkeypatch):
    monkeypatch.setattr(read_back_module, "SURE_RETRY_S", 0.0)

    async def run():
        request = _expired("the broker unreadable at first")
        first = answered_elsewhere(request)
        answers = [UNREADABLE, UNREADABLE, {request.request_id: first}]
        asked = []

        class Flaky(Reader):
            def find_many(self, topic, partition, wanted):
                asked.append(set(wanted))
                return answers.pop(0)

        worker = worker_with(Flaky(None), max_inflight=4)
        _put(worker, request, 0, written_ms=now_ms(), headers=AGAIN)
        worker.dispatch()
        await _until(lambda: sent(worker))
        assert sent(worker) == [first[0]] and asked == [{request.request_id}] * 3

    asyncio.run(run())


def test_a_read_back_that_never_gets_an_answer_ends_in_the_status_the_record_has(monkeypatch):
    monkeypatch.setattr(read_back_module, "SURE_RETRY_S", 0.0)

    async def run():
        request = _expired("the broker never readable")

        class Unreadable(Reader):
            def find_many(self, *args, **kwargs):
                return UNREADABLE

        worker = worker_with(Unreadable(None), max_inflight=4)
        _put(worker, request, 0, written_ms=now_ms(), headers=AGAIN)
        worker.dispatch()
        await _until(lambda: sent(worker))
        assert _statuses(worker) == [Status.EXPIRED.value]

    asyncio.run(run())


def test_a_sure_read_back_skips_the_cool_down_and_says_when_it_could_not_read():
    from confluent_kafka import KafkaError, KafkaException

    from pipeline.config import Settings
    from pipeline.worker.earlier_answers import EarlierAnswers

    reader = EarlierAnswers(Settings.load(env={}), "w", CODEC.decode_response, lambda topic: 3, 1000)
    scans = []

    def scan(*args):
        scans.append(args)
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT))

    reader._scan = scan
    assert reader.find("llm.responses", 0, "id-1", 0) is None  # starts the cool-down
    assert reader.find_many("llm.responses", 0, {"id-2": 50_000, "id-3": 20_000}) is UNREADABLE
    assert len(scans) == 2
    assert scans[1] == ("llm.responses", 0, {"id-2", "id-3"}, 20_000 - CLOCK_SKEW_MS)  # from the earliest


def test_a_handed_back_partition_forgets_when_it_was_assigned():
    worker = worker_with(Reader(None))
    tp = ("llm.dispatch.normal", 0)
    worker.processor.read_back.assigned([tp])
    worker.processor.hand_back({tp})
    assert tp not in worker.processor.read_back.assigned_at
    eo = worker_with(Reader(None), delivery="exactly-once")
    eo.processor.read_back.assigned([tp])
    assert eo.processor.read_back.assigned_at == {}


def test_a_read_back_that_fails_unexpectedly_still_answers_the_record():
    async def run():
        request = _expired("the reader has a bug")

        class Broken(Reader):
            def find_many(self, *args, **kwargs):
                raise RuntimeError("a bug")

        worker = worker_with(Broken(None), max_inflight=4)
        _put(worker, request, 0, written_ms=now_ms(), headers=AGAIN)
        worker.dispatch()
        await _until(lambda: sent(worker))
        assert _statuses(worker) == [Status.EXPIRED.value]

    asyncio.run(run())


def test_records_expiring_together_after_a_rebalance_are_read_back_in_one_pass():
    async def run():
        requests = [_expired(f"inherited {i}") for i in range(20)]
        reader = Reader(None)
        worker = worker_with(reader, max_inflight=32)
        tp = (worker.settings.topics.request_topic(requests[0].priority), 0)
        worker.processor.read_back.assigned([tp])
        for i, request in enumerate(requests):
            _put(worker, request, i, written_ms=now_ms() - 30_000)
        worker.dispatch()
        await _until(lambda: len(sent(worker)) == len(requests))
        assert _statuses(worker) == ["EXPIRED"] * len(requests)
        # One reply partition (the tenant's), one pass for all (a second for any arriving meanwhile).
        assert 1 <= len(reader.asked_many) <= 2
        assert set().union(*(w for _, _, w in reader.asked_many)) == {r.request_id for r in requests}
        await _until(lambda: not worker.processor.tasks and not worker.processor.read_back._readers)

    asyncio.run(run())


def test_one_pass_finds_the_first_terminal_answer_of_each_id_wanted():
    from pipeline.models import Response

    a, b, other = (dispatched(Request.new("tenant-a", p)) for p in ("a", "b", "someone else"))
    key = b"tenant-a"

    def enc(req, status, output=None):
        return CODEC.encode_response(Response.for_request(req, status, output=output)), key

    first_a, b_cancelled = enc(a, Status.COMPLETED, "first a"), enc(b, Status.CANCELLED)
    records = [enc(a, Status.QUEUED), enc(other, Status.COMPLETED, "x"), first_a,
               (b"garbage " + b.request_id.encode(), key), enc(a, Status.EXPIRED)]
    found: dict = {}
    first_terminals(records, {a.request_id, b.request_id}, CODEC.decode_response, found)
    assert found == {a.request_id: first_a}
    # A later batch of records: b found there, a keeps its first answer.
    first_terminals([enc(a, Status.COMPLETED, "a again"), b_cancelled], {a.request_id, b.request_id},
                    CODEC.decode_response, found)
    assert found == {a.request_id: first_a, b.request_id: b_cancelled}


def test_a_worker_driven_without_an_event_loop_answers_at_once():
    # Tools and benchmarks call Worker.handle outside any loop: nothing to run a read-back on.
    request = _expired("handled by a tool")
    worker = worker_with(Reader(None))
    tp = (worker.settings.topics.request_topic(request.priority), 0)
    worker.handle(FakeMessage(tp[0], 0, 0, CODEC.encode_request(request), b"tenant-a", AGAIN))
    assert _statuses(worker) == ["EXPIRED"]


def test_a_worker_is_in_doubt_while_its_loop_stood_still_past_the_session_or_holds_work():
    from pipeline.worker.state import Session

    session = Session()
    assert not session.in_doubt(100.0, 6.0)  # the loop has not turned yet: nothing to doubt
    session.turned_at = 100.0
    assert not session.in_doubt(105.9, 6.0)
    assert session.in_doubt(106.1, 6.0)  # frozen, not noticed yet
    session.turned_at, session.held_until = 107.0, 111.0  # noticed: holding work
    assert session.in_doubt(110.9, 6.0) and not session.in_doubt(111.1, 6.0)
