"""Priority-aware consumption inside one worker: higher bands first, lower bands never starved."""

from __future__ import annotations

import time

from confluent_kafka import Producer

from pipeline.models import Priority, Request, Status
from pipeline.serde import Codec
from pipeline.worker.backends.simulated import SimulatedBackend
from tests.integration.harness import read_topic, running_worker


def _queue(settings, band: Priority, n: int, tenant: str = "tenant-flood") -> list[Request]:
    codec = Codec.default()
    producer = Producer(settings.kafka.producer_config())
    reqs = [Request.new(f"{tenant}-{i % 5}", f"{band.value} {i}", priority=band, max_tokens=4, timeout_ms=600_000)
            for i in range(n)]
    for r in reqs:
        producer.produce(settings.topics.request_topic(band), codec.encode_request(r), r.tenant_id.encode())
        producer.poll(0)
    assert producer.flush(30) == 0
    return reqs


def _responses(settings, n: int):
    codec = Codec.default()
    msgs = read_topic(settings.kafka.bootstrap, settings.topics.responses, timeout=90, until=lambda ms: len(ms) >= n)
    return [codec.decode_response(m.value()) for m in msgs]


def test_a_critical_request_behind_1000_queued_background_ones_is_served_within_a_few(settings):
    settings.worker.max_inflight = 4
    background = _queue(settings, Priority.BACKGROUND, 1000)
    (critical,) = _queue(settings, Priority.CRITICAL, 1, tenant="tenant-urgent")
    with running_worker(settings, SimulatedBackend(latency_ms=5)):
        responses = _responses(settings, len(background) + 1)
    assert all(r.status is Status.COMPLETED for r in responses)
    crit = next(r for r in responses if r.request_id == critical.request_id)
    ahead = sum(1 for r in responses if r.started_at < crit.started_at)
    print(f"\nCRITICAL started after {ahead} of 1000 queued BACKGROUND requests")
    assert ahead <= 20


def test_lower_bands_keep_their_minimum_share_under_sustained_high_band_load(settings):
    settings.worker.max_inflight = 4
    high = _queue(settings, Priority.HIGH, 1500)
    background = _queue(settings, Priority.BACKGROUND, 300)
    with running_worker(settings, SimulatedBackend(latency_ms=2)):
        responses = _responses(settings, len(high) + len(background))
    by_start = sorted(responses, key=lambda r: r.started_at)[:1000]  # while both bands had work
    share = sum(1 for r in by_start if r.requested_priority is Priority.BACKGROUND) / len(by_start)
    print(f"\nBACKGROUND share under HIGH load: {share:.3f} (minimum {settings.worker.band_min_share['BACKGROUND']})")
    assert share >= settings.worker.band_min_share["BACKGROUND"] * 0.8
    assert share <= 0.5  # and HIGH still goes first


def test_a_critical_request_preempts_a_long_background_call_which_is_answered_once_later(settings):
    # One slot, held by a BACKGROUND call of 3 s: the CRITICAL request takes the slot at
    # once, and the BACKGROUND request runs again afterwards and is answered once.
    settings.worker.max_inflight = 1
    codec = Codec.default()
    producer = Producer(settings.kafka.producer_config())
    slow = Request.new("tenant-bulk", "a long batch job", priority=Priority.BACKGROUND, max_tokens=4,
                       timeout_ms=600_000, metadata={"sim.latency_ms": "3000"})
    producer.produce(settings.topics.request_topic(Priority.BACKGROUND), codec.encode_request(slow), b"tenant-bulk")
    assert producer.flush(30) == 0
    with running_worker(settings, SimulatedBackend(latency_ms=20)) as worker:  # every call takes a slot
        deadline = time.monotonic() + 60
        while not worker.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.running, "the BACKGROUND call never started"
        (urgent,) = _queue(settings, Priority.CRITICAL, 1, tenant="tenant-urgent")
        responses = _responses(settings, 2)
        time.sleep(1)  # a second answer to either would have arrived by now
        responses = _responses(settings, 2)
    responses.sort(key=lambda r: r.finished_at)
    assert [r.request_id for r in responses] == [urgent.request_id, slow.request_id]
    assert all(r.status is Status.COMPLETED for r in responses)
    crit = responses[0]
    assert crit.started_at - crit.created_at < 1500, "CRITICAL waited for the BACKGROUND call"
    assert worker.stats.preempted == 1


def test_a_quiet_tenant_does_not_wait_for_a_tenant_holding_every_slot_with_long_calls(settings):
    # Two slots, both held by one tenant's NORMAL calls of 3 s: another tenant's NORMAL request
    # takes one of them at once (worker.fair_preemption), and the flooder's call runs again
    # afterwards and is answered once.
    settings.worker.max_inflight = 2
    codec = Codec.default()
    producer = Producer(settings.kafka.producer_config())
    topic = settings.topics.request_topic(Priority.NORMAL)
    slow = [Request.new("tenant-flood", f"long job {i}", max_tokens=4, timeout_ms=600_000,
                        metadata={"sim.latency_ms": "3000"}) for i in range(2)]
    for r in slow:  # one partition for the flooder, another for the quiet tenant
        producer.produce(topic, codec.encode_request(r), b"tenant-flood", partition=0)
    assert producer.flush(30) == 0
    with running_worker(settings, SimulatedBackend(latency_ms=20)) as worker:
        deadline = time.monotonic() + 60
        while len(worker.running) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(worker.running) == 2, "the flooder's calls never filled both slots"
        quiet = Request.new("tenant-quiet", "a short question", max_tokens=4, timeout_ms=600_000)
        producer.produce(topic, codec.encode_request(quiet), b"tenant-quiet", partition=1)
        assert producer.flush(30) == 0
        responses = _responses(settings, 3)
        time.sleep(1)  # a second answer to any of them would have arrived by now
        responses = _responses(settings, 3)
    by_id = {r.request_id: r for r in responses}
    assert len(responses) == 3 and set(by_id) == {quiet.request_id, *(r.request_id for r in slow)}
    assert all(r.status is Status.COMPLETED for r in responses)
    q = by_id[quiet.request_id]
    assert q.started_at - q.created_at < 1500, "the quiet tenant waited for the flooder's call"
    assert worker.stats.preempted_in_band == 1
