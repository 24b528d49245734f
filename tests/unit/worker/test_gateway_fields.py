"""The worker copies the gateway's decisions (request revision 3) into every response it builds.

``admitted_at`` comes from the request, ``served_priority`` is the gateway's
``effective_priority`` (else the requested one) and ``degraded`` says the gateway rewrote
``model``; this holds for every outcome, not only COMPLETED. Driven without a broker, with
the fake producer and messages of the admission fuzzer.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pipeline.errors import BackendError
from pipeline.models import Priority, Request, Response, Status, now_ms
from pipeline.serde import Codec
from pipeline.testing import FakeMessage
from pipeline.worker.backends.base import Completion
from pipeline.worker.backends.simulated import SimulatedBackend
from tests.unit.worker.test_admission_fuzz import make_worker

ADMITTED_AT = 1_700_000_000_500


def _gateway_request(**over) -> Request:
    """A LOW request the gateway admitted, raised to HIGH and moved to a smaller model."""
    fields = dict(priority=Priority.LOW, model="sim-small", admitted_at=ADMITTED_AT,
                  effective_priority=Priority.HIGH, degraded_from="sim-large", trace_id="trace-1")
    fields.update(over)
    return Request.new("tenant-gw", "hello", **fields)


def _run(worker, req: Request | bytes, offset: int = 0) -> Response:
    """Hand one request to the worker; return the response it published for it."""
    topic = worker.settings.topics.request_topic(Priority.LOW)
    value = req if isinstance(req, bytes) else Codec.default().encode_request(req)
    before = len(worker.producer.sent)
    worker.handle(FakeMessage(topic, 0, offset, value, b"tenant-gw"))
    out = worker.producer.sent[before:]
    assert len(out) == 1 and out[0].topic() == worker.responses_topic
    return worker.codec.decode_response(out[0].value())


def _assert_gateway_fields(resp: Response) -> None:
    assert resp.admitted_at == ADMITTED_AT
    assert resp.requested_priority is Priority.LOW
    assert resp.served_priority is Priority.HIGH
    assert resp.degraded is True


def test_completed_carries_the_gateway_fields():
    worker = make_worker()
    req = _gateway_request()
    resp = _run(worker, req)
    assert resp.status is Status.COMPLETED
    _assert_gateway_fields(resp)
    assert resp.model == "sim-small"  # the model it was served by: the gateway's choice
    assert resp.metadata == {"trace_id": "trace-1"}


def test_completed_without_a_gateway():
    worker = make_worker()
    req = Request.new("tenant-gw", "hello", priority=Priority.LOW)
    resp = _run(worker, req)
    assert resp.status is Status.COMPLETED
    assert (resp.admitted_at, resp.served_priority, resp.degraded) == (None, Priority.LOW, False)


def test_effective_priority_alone_and_degradation_alone():
    worker = make_worker()
    resp = _run(worker, _gateway_request(degraded_from=None, admitted_at=None), 0)
    assert (resp.served_priority, resp.degraded, resp.admitted_at) == (Priority.HIGH, False, None)
    resp = _run(worker, _gateway_request(effective_priority=None), 1)
    assert (resp.served_priority, resp.degraded) == (Priority.LOW, True)


def test_expired_carries_the_gateway_fields():
    worker = make_worker()
    resp = _run(worker, _gateway_request(created_at=now_ms() - 10_000, timeout_ms=1))
    assert resp.status is Status.EXPIRED
    _assert_gateway_fields(resp)


def test_rejected_invalid_and_duplicate_carry_the_gateway_fields():
    worker = make_worker()
    resp = _run(worker, _gateway_request(max_tokens=0), 0)
    assert resp.status is Status.REJECTED and resp.reason.startswith("invalid_request")
    _assert_gateway_fields(resp)
    req = _gateway_request()
    data = Codec.default().encode_request(req)
    first = _run(worker, data, 1)
    assert first.status is Status.COMPLETED
    resp = _run(worker, data, 2)  # the copy is given the first answer, gateway fields and all
    assert resp == first
    _assert_gateway_fields(resp)
    # another tenant's request with that id is refused, with its own gateway fields
    resp = _run(worker, dataclasses.replace(req, tenant_id="tenant-other"), 3)
    assert resp.status is Status.REJECTED and resp.reason.startswith("duplicate_request_id")
    assert resp.tenant_id == "tenant-other"
    _assert_gateway_fields(resp)


def test_cancelled_carries_the_gateway_fields():
    class Cancelled:
        def reason(self, request_id):
            return "changed my mind"

    worker = make_worker()
    worker.session.cancellations = Cancelled()
    resp = _run(worker, _gateway_request())
    assert resp.status is Status.CANCELLED
    _assert_gateway_fields(resp)


@pytest.mark.parametrize("error", [BackendError("model down"), RuntimeError("backend bug")])
def test_failed_carries_the_gateway_fields(error):
    class Broken(SimulatedBackend):
        def complete_now(self, request):
            return None  # go through the asynchronous call

        async def complete(self, request):
            raise error

    worker = make_worker(Broken())

    async def scenario() -> Response:
        before = len(worker.producer.sent)
        topic = worker.settings.topics.request_topic(Priority.LOW)
        worker.handle(FakeMessage(topic, 0, 0, Codec.default().encode_request(_gateway_request()), b"k"))
        await asyncio.gather(*worker.running.values())
        (out,) = worker.producer.sent[before:]
        return worker.codec.decode_response(out.value())

    resp = asyncio.run(scenario())
    assert resp.status is Status.FAILED and resp.reason.startswith("backend_error")
    _assert_gateway_fields(resp)
    assert resp.model == "sim-small"


def test_the_too_large_fallback_keeps_the_gateway_fields():
    class Runaway(SimulatedBackend):
        def complete_now(self, request):
            return Completion("x" * 20_000, 1, 5_000, request.model)  # over max_record_bytes

    worker = make_worker(Runaway())
    resp = _run(worker, _gateway_request())
    assert resp.status is Status.FAILED and resp.reason.startswith("response_too_large")
    _assert_gateway_fields(resp)


def test_completed_response_has_every_field_in_place():
    # The hot path encodes the response from a tuple of its fields: every field must land
    # where a keyword-built Response puts it.
    worker = make_worker()
    req = _gateway_request(metadata={"ignored": "by the worker"})
    resp = _run(worker, req)
    answer = SimulatedBackend().answer(req)
    assert resp == Response(
        request_id=req.request_id, tenant_id=req.tenant_id, status=Status.COMPLETED, reason=None,
        output=answer.output, prompt_tokens=answer.prompt_tokens, completion_tokens=answer.completion_tokens,
        model="sim-small", degraded=True, requested_priority=Priority.LOW, served_priority=Priority.HIGH,
        created_at=req.created_at, admitted_at=ADMITTED_AT, started_at=resp.started_at,
        finished_at=resp.finished_at, worker_id="fuzz-worker", retry_after_ms=None,
        metadata={"trace_id": "trace-1"}, queue_position=None, eta_ms=None)
    assert req.created_at <= resp.started_at <= resp.finished_at <= now_ms()


def test_completed_response_over_the_caps_is_answered_failed():
    # A runaway output the tuple encoder refuses goes through the Response path and its
    # size check: a FAILED answer, not a lost request.
    worker = make_worker()
    worker.backend.complete_now = lambda request: Completion("x" * (2 << 20), 1, 1, request.model)
    resp = _run(worker, _gateway_request())
    assert resp.status is Status.FAILED
    assert resp.reason.startswith("response_too_large")
    _assert_gateway_fields(resp)


def test_duplicate_ids_are_remembered_for_the_dedupe_window_only():
    worker = make_worker()
    worker.recent.window = 3
    reqs = [_gateway_request() for _ in range(5)]
    firsts = [_run(worker, r, i) for i, r in enumerate(reqs)]
    assert _run(worker, reqs[4], 5) == firsts[4]  # within the window: the first answer again
    assert worker.stats.duplicates == 1
    _run(worker, reqs[0], 6)  # pushed out by newer answers: taken again, run again
    assert worker.stats.duplicates == 1 and worker.stats.completed == 6
    assert len(worker.recent) == 3
