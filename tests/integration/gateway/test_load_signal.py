"""The gateway sees capacity it loses: workers slowed tenfold lead to degraded answers and to
queue_full with a retry-after from the drain it measures, through the real broker."""

from __future__ import annotations

import time

from confluent_kafka import Producer

from pipeline.models import Priority, Request, Status
from pipeline.serde import Codec
from pipeline.testing import produce_request
from pipeline.worker.backends.simulated import SimulatedBackend
from tests.integration.gateway.test_gateway import running_gateway
from tests.integration.harness import read_topic, running_worker

CAP = 150
TOML = f"""
[gateway]
web_port = 0
target_queue_ms = 500
# demotion off (the load never exceeds 10): what this test watches is NORMAL's own queue filling
high_load = 100.0
depth_refresh_ms = 250

[gateway.downgrade]
"sim-large" = "sim-small"

[gateway.queue_caps]
NORMAL = {CAP}
"""


def _send(producer, settings, codec, n: int, rate: float) -> list[Request]:
    reqs = []
    t0 = time.monotonic()
    for i in range(n):
        req = Request.new(f"tenant-{i % 10}", f"p{i}", model="sim-large", allow_degrade=True, max_tokens=8,
                          timeout_ms=600_000)
        produce_request(producer, settings, codec, req)
        reqs.append(req)
        time.sleep(max(0.0, t0 + (i + 1) / rate - time.monotonic()))
    producer.flush(10)
    return reqs


def test_a_slowed_worker_leads_to_degraded_answers_and_queue_full_with_retry_after(settings, tmp_path):
    s = settings
    s.worker.source = "dispatch"
    codec = Codec.default()
    producer = Producer(s.kafka.producer_config())
    s.worker.max_inflight = 2
    with running_gateway(s, tmp_path, toml=TOML):
        with running_worker(s, SimulatedBackend(latency_ms=10)):  # 2 slots x 10 ms: 200/s
            # The worker's first assignment takes seconds, and what waited meanwhile was load;
            # once it answers, the gateway's wait estimate decays within a few seconds.
            first = _send(producer, s, codec, 10, rate=50)
            read_topic(s.kafka.bootstrap, s.topics.responses, timeout=60, until=lambda ms: len(ms) >= len(first))
            time.sleep(8)
            steady = _send(producer, s, codec, 250, rate=50)
            time.sleep(2)
        with running_worker(s, SimulatedBackend(latency_ms=100)):  # tenfold slower: 20/s
            slow = _send(producer, s, codec, 600, rate=50)
            time.sleep(3)
    codec = Codec.default()
    answers = {}
    for m in read_topic(s.kafka.bootstrap, s.topics.responses, timeout=30):
        r = codec.decode_response(m.value())
        if r.status.is_terminal:
            answers.setdefault(r.request_id, r)
    fast = [answers[r.request_id] for r in steady if r.request_id in answers]
    assert fast and not any(a.degraded for a in fast)  # at 50/s of 200/s nothing waits: no load
    later = [answers.get(r.request_id) for r in slow]
    degraded = [a for a in later if a is not None and a.degraded]
    full = [a for a in later if a is not None and a.status is Status.REJECTED and a.reason.startswith("queue_full")]
    print(f"\nafter the slowdown: {len(degraded)} degraded answers, {len(full)} queue_full refusals, "
          f"retry-after {sorted(a.retry_after_ms for a in full)[:5]}...")
    assert degraded, "the gateway never saw the load rise"
    assert all(a.model == "sim-small" for a in degraded)
    assert full, "the band never filled"
    # retry-after from the drain the gateway measures (~20/s): a queue over its cap by one drains
    # in about 50 ms, by a few dozen in a second or two; never the 60-s ceiling of an unknown rate.
    assert all(100 <= a.retry_after_ms < 10_000 for a in full)
    assert all(a.served_priority is Priority.NORMAL for a in full)
