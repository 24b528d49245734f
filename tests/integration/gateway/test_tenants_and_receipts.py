"""Through the real broker: the gateway applies the tenant registry (tier, highest band, models,
its own caps), and a tenant whose answers go to another partition than its own gets its quota
back from the workers' receipts."""

from __future__ import annotations

import time

from confluent_kafka import Producer

from pipeline.models import Priority, Request, Status
from pipeline.partitioning import tenant_partition
from pipeline.serde import Codec
from pipeline.testing import produce_request
from pipeline.worker.backends.simulated import SimulatedBackend
from tests.integration.gateway.test_gateway import running_gateway
from tests.integration.harness import read_topic, running_worker

TOML = """
[gateway]
web_port = 0
demote_floor = "NORMAL"

[tenants]
require_known = true

[tenants.records.acme]
tier = "standard"
max_priority = "HIGH"
models = ["sim-small"]

[tenants.records.acme.outstanding]
NORMAL = 1
"""


def test_the_registry_shapes_requests_and_receipts_return_the_quota(settings, tmp_path):
    s = settings
    s.worker.source = "dispatch"
    codec = Codec.default()
    producer = Producer(s.kafka.producer_config())
    home = tenant_partition(b"acme", s.topics.response_partitions)
    elsewhere = (home + 1) % s.topics.response_partitions
    answers: dict[str, tuple[int, object]] = {}

    def answer_of(req: Request, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in read_topic(s.kafka.bootstrap, s.topics.responses, timeout=2):
                r = codec.decode_response(m.value())
                if r.status.is_terminal:
                    answers.setdefault(r.request_id, (m.partition(), r))
            if req.request_id in answers:
                return answers[req.request_id]
        raise AssertionError(f"no answer to {req.request_id}")

    with running_gateway(s, tmp_path, toml=TOML), running_worker(s, SimulatedBackend(latency_ms=5)):
        # One at a time, each answered in another partition than the tenant's: with a cap of one
        # outstanding NORMAL request, each is admitted only if the one before was counted finished.
        served = []
        for i in range(4):
            req = Request.new("acme", f"q{i}", model="sim-small", max_tokens=4, timeout_ms=120_000,
                              reply_partition=elsewhere, user_tier="enterprise")  # a claim: ignored
            produce_request(producer, s, codec, req)
            producer.flush(10)
            partition, answer = answer_of(req)
            assert partition == elsewhere
            served.append((answer.status, answer.served_priority))
        assert served == [(Status.COMPLETED, Priority.NORMAL)] * 4

        asks_too_much = Request.new("acme", "urgent", model="sim-small", priority=Priority.CRITICAL, max_tokens=4,
                                    timeout_ms=120_000)
        wrong_model = Request.new("acme", "big", model="sim-large", timeout_ms=120_000)
        stranger = Request.new("nobody", "hi", model="sim-small", timeout_ms=120_000)
        for req in (asks_too_much, wrong_model, stranger):
            produce_request(producer, s, codec, req)
        producer.flush(10)
        _, urgent = answer_of(asks_too_much)
        _, forbidden = answer_of(wrong_model)
        _, unknown = answer_of(stranger)
    assert urgent.status is Status.COMPLETED and urgent.served_priority is Priority.HIGH
    assert forbidden.status is Status.REJECTED and forbidden.reason.startswith("forbidden")
    assert unknown.status is Status.REJECTED and unknown.reason.startswith("unauthorized")
    receipts = [codec.decode_response(m.value()) for m in read_topic(s.kafka.bootstrap, s.topics.receipts)]
    assert len(receipts) == 4 and all(r.output is None for r in receipts)
