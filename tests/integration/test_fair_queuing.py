"""Fair queuing and shaping on the real broker: a quiet tenant on a flooder's partition is served
at the next free slot; a burst over a rate limit is admitted and started at the limit's pace."""

from __future__ import annotations

import collections
import time

from confluent_kafka import Producer

from pipeline.client import LlmqClient
from pipeline.models import NOT_BEFORE_HEADER, Priority, Request, Status
from pipeline.partitioning import tenant_partition
from pipeline.serde import Codec
from pipeline.testing import produce_request
from pipeline.worker.backends.simulated import SimulatedBackend
from tests.integration.gateway.test_gateway import running_gateway
from tests.integration.harness import read_topic, running_worker


def _same_partition_as(tenant: str, partitions: int) -> str:
    target = tenant_partition(tenant.encode(), partitions)
    return next(name for name in (f"quiet-{i}" for i in range(1000))
                if tenant_partition(name.encode(), partitions) == target)


def _answers(settings, ids: set[str], timeout_s: float = 60.0) -> dict:
    codec = Codec.default()
    deadline = time.monotonic() + timeout_s
    while True:
        got = {}
        for m in read_topic(settings.kafka.bootstrap, settings.topics.responses):
            r = codec.decode_response(m.value())
            if r.request_id in ids and r.status is not Status.QUEUED:
                got[r.request_id] = r
        if len(got) == len(ids) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_a_quiet_tenant_on_the_flooders_partition_starts_ahead_of_the_flooders_backlog(settings):
    s = settings
    quiet_name = _same_partition_as("flooder", s.topics.request_partitions)
    codec = Codec.default()
    producer = Producer(s.kafka.producer_config())
    flood = [Request.new("flooder", f"f{i}", timeout_ms=600_000, max_tokens=4) for i in range(150)]
    for r in flood:
        produce_request(producer, s, codec, r)
    quiet = Request.new(quiet_name, "q", timeout_ms=600_000, max_tokens=4)
    produce_request(producer, s, codec, quiet)  # behind 150 of the flooder's, in the same partition
    assert producer.flush(10) == 0
    # One slot, 20 ms a call: first come, first served would start the quiet one after ~3 s.
    s.worker.max_inflight = 1
    with running_worker(s, SimulatedBackend(20), worker_id="fair-1"):
        got = _answers(s, {r.request_id for r in [*flood, quiet]})
    assert len(got) == 151 and all(r.status is Status.COMPLETED for r in got.values())
    starts = sorted(got.values(), key=lambda r: r.started_at)
    position = [r.request_id for r in starts].index(quiet.request_id)
    assert position <= 5, f"the quiet tenant started {position}th"


def test_a_burst_over_a_delay_limit_is_all_answered_and_started_at_the_limits_pace(settings, tmp_path):
    s = settings
    s.worker.source = "dispatch"
    toml = """
[gateway]
web_port = 0

[gateway.limits.paced]
window_ms = 1000
requests = 20
burst = 5
"""
    reqs = [Request.new("bursty", f"b{i}", timeout_ms=60_000, max_tokens=4) for i in range(45)]
    with running_gateway(s, tmp_path, toml=toml), running_worker(s, SimulatedBackend(), worker_id="pace-1"), \
            LlmqClient(s) as client:
        for r in reqs:
            client.submit(r)
        got = _answers(s, {r.request_id for r in reqs})
    assert collections.Counter(r.status for r in got.values()) == {Status.COMPLETED: 45}
    # The gateway's schedule, on the buckets' clock (arrivals): each shaped request's not-before
    # time, the others' arrival (about their creation). Over any second it allows at most burst +
    # rate; the 40 over the burst spread over about 2 s.
    codec = Codec.default()
    not_before = {}
    for p in Priority:
        for m in read_topic(s.kafka.bootstrap, s.topics.dispatch_topic(p)):
            at = dict(m.headers() or ()).get(NOT_BEFORE_HEADER)
            if at is not None:
                not_before[codec.decode_request(m.value()).request_id] = int(at)
    assert len(not_before) >= 35
    schedule = sorted(not_before.get(rid, r.created_at) for rid, r in got.items())
    most = max(sum(1 for t in schedule if a <= t < a + 1000) for a in schedule)
    assert most <= 25, most
    assert schedule[-1] - schedule[0] >= 1_500
    # No worker started a shaped request before its time.
    assert all(got[rid].started_at >= at for rid, at in not_before.items())
