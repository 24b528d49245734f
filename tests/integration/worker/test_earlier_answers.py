"""A copy the gateway dispatched again, reaching a worker that never took the first copy: the
worker reads the first answer back from the responses topic and gives it again, byte for byte.

On the real broker, with a real worker (simulated model), in both delivery modes: the first
answer sits among other tenants' answers and progress events, as another worker left it; a
second copy whose first answer is nowhere runs as a new request.
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer

from pipeline.models import DISPATCHED_AGAIN_HEADER, RESUBMITTED, Priority, Request, Response, Status
from pipeline.serde import Codec
from pipeline.worker.earlier_answers import EarlierAnswers
from tests.integration.harness import read_topic, running_worker

CODEC = Codec.default()


def _admitted(tenant: str, prompt: str) -> Request:
    req = Request.new(tenant, prompt, max_tokens=4, timeout_ms=600_000)
    req.admitted_at, req.effective_priority = req.created_at, Priority.NORMAL
    return req


def _answered_by_another_worker(req: Request) -> bytes:
    return CODEC.encode_response(Response.for_request(
        req, Status.COMPLETED, output="what the first run said", worker_id="another-worker",
        admitted_at=req.admitted_at, started_at=req.admitted_at + 1, finished_at=req.admitted_at + 2,
        completion_tokens=5))


@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
def test_a_copy_dispatched_again_gets_the_answer_another_worker_gave(settings, delivery):
    s = settings
    s.worker.source, s.worker.delivery = "dispatch", delivery
    answered, unanswered = _admitted("tenant-a", "answered before"), _admitted("tenant-a", "never answered")
    first = _answered_by_another_worker(answered)
    producer = Producer(s.kafka.producer_config())
    # Other traffic around the first answer in its partition: another id, a progress event.
    noise = _admitted("tenant-a", "someone else")
    producer.produce(s.topics.responses, CODEC.encode_response(Response.for_request(answered, Status.QUEUED,
                                                                                    queue_position=1)), b"tenant-a")
    producer.produce(s.topics.responses, _answered_by_another_worker(noise), b"tenant-a")
    producer.produce(s.topics.responses, first, b"tenant-a")
    dispatch = s.topics.dispatch_topic(Priority.NORMAL)
    for req in (answered, unanswered):
        producer.produce(dispatch, CODEC.encode_request(req), b"tenant-a", headers=[(DISPATCHED_AGAIN_HEADER, RESUBMITTED)])
    assert producer.flush(30) == 0

    def both_answered(msgs) -> bool:
        ids = [CODEC.decode_response(m.value()).request_id for m in msgs]
        return ids.count(answered.request_id) >= 2 and unanswered.request_id in ids

    with running_worker(s, worker_id="w-lookup") as worker:
        msgs = read_topic(s.kafka.bootstrap, s.topics.responses, until=both_answered, timeout=60)
        time.sleep(0.5)
    got = [m.value() for m in msgs if CODEC.decode_response(m.value()).request_id == answered.request_id
           and CODEC.decode_response(m.value()).status.is_terminal]
    assert got == [first, first]  # the first answer, given again byte for byte
    [ran] = [CODEC.decode_response(m.value()) for m in msgs
             if CODEC.decode_response(m.value()).request_id == unanswered.request_id]
    assert ran.status is Status.COMPLETED and ran.worker_id == "w-lookup"
    assert worker.ctx.earlier.found == 1 and worker.ctx.earlier.missed == 1
    assert worker.stats.completed == 1 and worker.stats.duplicates == 1  # the model ran for one copy only


def test_reading_back_starts_at_the_first_admission(settings):
    s = settings
    req = _admitted("tenant-b", "answered long ago")
    producer = Producer(s.kafka.producer_config())
    producer.produce(s.topics.responses, _answered_by_another_worker(req), b"tenant-b", partition=1,
                     timestamp=req.admitted_at - 3_600_000)  # before its admission, past any clock skew
    assert producer.flush(30) == 0
    reader = EarlierAnswers(s, "w-reader", CODEC.decode_response, lambda topic: 3, 1000)
    try:
        assert reader.find(s.topics.responses, 1, req.request_id, req.admitted_at) is None
        assert reader.find(s.topics.responses, 1, req.request_id, req.admitted_at - 3_600_000) is not None
        assert reader.find(s.topics.responses, 2, req.request_id, 0) is None  # another partition
    finally:
        reader.close()
