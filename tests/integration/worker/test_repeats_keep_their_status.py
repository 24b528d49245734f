"""A request id answered once keeps its status when it is read again: never EXPIRED or CANCELLED
after a first COMPLETED answer.

On the real broker, in two ways a record reaches a worker that never saw its first answer:

* the worker that answered it is SIGKILLed before committing (a real process), and the
  partition's next owner takes the record again after its deadline has passed, or after a
  cancellation for it was published (serve withdraws a request whose write timed out);
* a gateway dispatched a copy again (``llmq-dispatched-again``) that arrives past the deadline
  or after a cancellation, at a worker that did not take the first copy;
* a worker frozen (SIGSTOP) past its session with a call in flight, whose partition's next owner
  answers the record EXPIRED meanwhile: resumed, the frozen worker must not publish its COMPLETED.

In each, the record must get its first answer again (at-least-once, byte for byte; exactly-once,
a redelivered copy nothing at all), and a record with no first answer anywhere is still answered
EXPIRED.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from confluent_kafka import Producer

from pipeline.cancellations import cancellation_record
from pipeline.models import DISPATCHED_AGAIN_HEADER, REDELIVERED, Priority, Request, Response, Status, now_ms
from pipeline.serde import Codec
from tests.integration.harness import LlmqProcess, read_topic, running_worker

CODEC = Codec.default()


def _dispatched(tenant: str, prompt: str, timeout_ms: int, created_at: int | None = None) -> Request:
    req = Request.new(tenant, prompt, max_tokens=4, timeout_ms=timeout_ms)
    if created_at is not None:
        req.created_at = created_at
    req.admitted_at, req.effective_priority = req.created_at, Priority.NORMAL
    return req


def _terminal(settings, request_id: str, count: int, timeout: float) -> list[bytes]:
    """The first ``count`` terminal answers to ``request_id``, in the order read."""
    def enough(msgs) -> bool:
        return len(_of(msgs, request_id)) >= count

    return _of(read_topic(settings.kafka.bootstrap, settings.topics.responses, until=enough, timeout=timeout),
               request_id)


def _of(msgs, request_id: str) -> list[bytes]:
    out = []
    for m in msgs:
        resp = CODEC.decode_response(m.value())
        if resp.request_id == request_id and resp.status.is_terminal:
            out.append(m.value())
    return out


def _worker_process(settings, name: str, tmp_path, latency_ms: int = 0) -> LlmqProcess:
    env = {**os.environ, **settings.topology_env(), "LLMQ_WORKER__SOURCE": "dispatch",
           # Never commits on its own before the kill: what it answered stays past the committed offset.
           "LLMQ_WORKER__COMMIT_INTERVAL_MS": "3600000", "LLMQ_WORKER__METRICS_PORT": "0",
           "LLMQ_WORKER__SESSION_TIMEOUT_MS": "6000"}
    return LlmqProcess(name, [sys.executable, "-m", "pipeline.cli", "--log-level", "INFO", "worker",
                              "--worker-id", name, "--sim-latency-ms", str(latency_ms)], env, tmp_path,
                       ready="assigned")


@pytest.mark.parametrize("then", ["deadline passed", "cancelled"])
def test_a_record_answered_before_a_kill_keeps_its_status_at_the_next_owner(settings, tmp_path, then):
    s = settings
    first_owner = _worker_process(s, "w-first", tmp_path)
    first_owner.start()
    next_owner = _worker_process(s, "w-next", tmp_path)
    try:
        first_owner.wait_ready(60)
        req = _dispatched("tenant-k", "answered, then its worker killed", timeout_ms=6_000)
        producer = Producer(s.kafka.producer_config())
        producer.produce(s.topics.dispatch_topic(Priority.NORMAL), CODEC.encode_request(req), b"tenant-k")
        assert producer.flush(30) == 0
        [first] = _terminal(s, req.request_id, 1, timeout=30)
        assert CODEC.decode_response(first).status is Status.COMPLETED
        first_owner.kill()  # before its commit: the record is past the group's committed offset
        if then == "cancelled":
            key, value = cancellation_record(req.request_id, "not written to Kafka in time")
            producer.produce(s.topics.cancellations, value, key)
            assert producer.flush(30) == 0
        else:
            time.sleep(max(0.0, (req.created_at + req.timeout_ms - now_ms()) / 1000 + 0.5))
        next_owner.start()
        answers = _terminal(s, req.request_id, 2, timeout=60)
    finally:
        next_owner.stop()
        first_owner.stop()
    statuses = [CODEC.decode_response(v).status.value for v in answers]
    assert statuses == ["COMPLETED", "COMPLETED"], f"{then}: the next owner answered {statuses[1]}"
    assert answers[1] == answers[0]  # the first answer again, byte for byte


@pytest.mark.parametrize("then", ["deadline passed", "cancelled"])
@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
def test_a_copy_dispatched_again_keeps_the_status_of_its_first_answer(settings, delivery, then):
    s = settings
    s.worker.source, s.worker.delivery = "dispatch", delivery
    created = now_ms() - 120_000 if then == "deadline passed" else None  # a 60-s deadline, passed a minute ago
    answered = _dispatched("tenant-a", "answered by another worker", 60_000, created)
    nowhere = _dispatched("tenant-a", "first copy never answered", 60_000, created)
    first = CODEC.encode_response(Response.for_request(
        answered, Status.COMPLETED, output="what the first run said", worker_id="another-worker",
        admitted_at=answered.admitted_at, started_at=answered.admitted_at + 1, finished_at=answered.admitted_at + 2,
        completion_tokens=5))
    producer = Producer(s.kafka.producer_config())
    producer.produce(s.topics.responses, first, b"tenant-a")
    if then == "cancelled":
        for req in (answered, nowhere):
            key, value = cancellation_record(req.request_id, "not written to Kafka in time")
            producer.produce(s.topics.cancellations, value, key)
    assert producer.flush(30) == 0
    dispatch = s.topics.dispatch_topic(Priority.NORMAL)
    with running_worker(s, worker_id="w-copy") as worker:
        time.sleep(3.0)  # written after the worker took its partitions, and read its cancellations
        for req in (answered, nowhere):
            producer.produce(dispatch, CODEC.encode_request(req), b"tenant-a",
                             headers=[(DISPATCHED_AGAIN_HEADER, REDELIVERED)])
        assert producer.flush(30) == 0
        [refused] = _terminal(s, nowhere.request_id, 1, timeout=60)
        time.sleep(2.0)  # the other copy's answer, if any, gets a moment to show up
    expected = Status.EXPIRED if then == "deadline passed" else Status.CANCELLED
    assert CODEC.decode_response(refused).status is expected  # no first answer anywhere: answered as it is
    got = _of(read_topic(s.kafka.bootstrap, s.topics.responses, timeout=10), answered.request_id)
    statuses = [CODEC.decode_response(v).status.value for v in got]
    if delivery == "at-least-once":
        assert got == [first, first], f"{then}: answered {statuses}"
    else:  # a redelivered copy whose first answer is known is not answered again
        assert got == [first], f"{then}: answered {statuses}"
    assert worker.stats.completed == 0  # the model ran for neither


def test_a_worker_frozen_with_a_call_in_flight_does_not_answer_after_the_next_owner(settings, tmp_path):
    s = settings
    zombie = _worker_process(s, "w-zombie", tmp_path, latency_ms=4_000)
    next_owner = _worker_process(s, "w-next", tmp_path)
    zombie.start()
    try:
        zombie.wait_ready(60)
        time.sleep(3)  # every partition assigned to it
        req = _dispatched("tenant-z", "in flight when its worker froze", timeout_ms=7_000)
        producer = Producer(s.kafka.producer_config())
        producer.produce(s.topics.dispatch_topic(Priority.NORMAL), CODEC.encode_request(req), b"tenant-z")
        assert producer.flush(30) == 0
        time.sleep(1.5)  # taken: its 4-s model call runs
        zombie.proc.send_signal(signal.SIGSTOP)  # past its 6-s session: the group gives its partitions away
        next_owner.start()
        [first] = _terminal(s, req.request_id, 1, timeout=60)
        assert CODEC.decode_response(first).status is Status.EXPIRED  # the deadline passed meanwhile
        zombie.proc.send_signal(signal.SIGCONT)
        time.sleep(8)  # the zombie's call ends, its partitions are reported lost
        answers = _of(read_topic(s.kafka.bootstrap, s.topics.responses, timeout=10), req.request_id)
    finally:
        zombie.proc.send_signal(signal.SIGCONT)
        next_owner.stop()
        zombie.stop()
    got = [(CODEC.decode_response(v).status.value, CODEC.decode_response(v).worker_id) for v in answers]
    assert got == [("EXPIRED", "w-next")], f"answers: {got}"
