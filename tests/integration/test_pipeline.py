"""Requests flow from the per-priority topics through a worker to the response topic."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.client import AsyncLlmqClient, LlmqClient
from pipeline.dlq import header_dict
from pipeline.models import Priority, Request, Status
from pipeline.serde import Codec
from pipeline.worker.backends.simulated import expected_output
from tests.integration.harness import committed_offsets, end_offsets, read_topic, running_worker


def test_a_request_of_every_priority_round_trips_through_its_topic(settings):
    with running_worker(settings), LlmqClient(settings) as client:
        requests = [Request.new(f"tenant-{p.value.lower()}", f"prompt for {p.value}", priority=p) for p in Priority]
        for req in requests:
            sub = client.submit(req)
            assert sub.topic == settings.topics.request_topic(req.priority)
        for req in requests:
            resp = client.result(req.request_id, timeout=30)
            assert resp.status is Status.COMPLETED, resp.reason
            assert resp.request_id == req.request_id and resp.tenant_id == req.tenant_id
            assert resp.requested_priority is req.priority and resp.served_priority is req.priority
            assert resp.output == expected_output(req)
            assert resp.created_at == req.created_at
            assert resp.started_at is not None and resp.finished_at >= resp.started_at
            assert resp.worker_id


def test_requests_are_keyed_by_tenant_and_responses_commit_behind(settings):
    with running_worker(settings), LlmqClient(settings) as client:
        reqs = [Request.new("tenant-a" if i % 2 else "tenant-b", f"p{i}", priority=Priority.NORMAL)
                for i in range(50)]
        subs = [client.submit_nowait(r) for r in reqs]
        partitions = {}
        for req, fut in zip(reqs, subs):
            partitions.setdefault(req.tenant_id, set()).add(fut.result(30).partition)
        assert all(len(p) == 1 for p in partitions.values())  # one tenant, one partition
        for req in reqs:
            assert client.result(req.request_id, timeout=30).status is Status.COMPLETED
    # After the worker stopped (drain + commit), its group's position is at the end of the topic.
    topic = settings.topics.request_topic(Priority.NORMAL)
    committed = committed_offsets(settings.kafka.bootstrap, settings.worker.group_id, [topic])
    ends = end_offsets(settings.kafka.bootstrap, [topic])
    for tp, end in ends.items():
        if end > 0:
            assert committed[tp] == end


def test_async_client_submits_and_awaits(settings):
    async def scenario():
        async with AsyncLlmqClient(settings) as client:
            reqs = [Request.new("tenant-async", f"q{i}", priority=Priority.HIGH) for i in range(20)]
            await asyncio.gather(*(client.submit(r) for r in reqs))
            return await asyncio.gather(*(client.result(r.request_id, timeout=30) for r in reqs)), reqs

    with running_worker(settings):
        responses, reqs = asyncio.run(scenario())
    assert [r.request_id for r in responses] == [r.request_id for r in reqs]
    assert all(r.status is Status.COMPLETED for r in responses)


def test_undecodable_messages_go_to_the_dlq_with_original_bytes_and_reason(settings):
    from confluent_kafka import Producer

    topic = settings.topics.request_topic(Priority.LOW)
    garbage = {
        b"definitely not avro": "bad_magic",
        b"\xc3\x01" + b"\x00" * 8 + b"\x02ab": "unknown_fingerprint",
        b"\xc3\x01": "truncated",
        b"\x00\x00\x00\x00\x07rest": "unknown_schema_id",
    }
    producer = Producer({"bootstrap.servers": settings.kafka.bootstrap})
    for value in garbage:
        producer.produce(topic, value, b"tenant-x", partition=0, headers=[("from", b"test")])
    valid = Request.new("tenant-x", "still served after the garbage", priority=Priority.LOW)
    producer.produce(topic, Codec.default().encode_request(valid), b"tenant-x", partition=0)
    assert producer.flush(10) == 0

    # The responses read from the topic's start: a client reads from where the topic ends when its
    # listener is assigned, which a worker answering the waiting request at once can beat.
    codec = Codec.default()

    def answered(msgs):
        return any(codec.decode_response(m.value()).request_id == valid.request_id for m in msgs)

    with running_worker(settings) as worker:
        got = [codec.decode_response(m.value()) for m in read_topic(settings.kafka.bootstrap, settings.topics.responses,
                                                                    until=answered, timeout=60)]
        assert [r.status for r in got if r.request_id == valid.request_id][-1] is Status.COMPLETED
        letters = read_topic(settings.kafka.bootstrap, settings.topics.dlq, until=lambda m: len(m) >= len(garbage))
        assert worker.stats.dead_lettered == len(garbage)
    by_value = {m.value(): m for m in letters}
    assert set(by_value) == set(garbage)
    for value, reason in garbage.items():
        msg = by_value[value]
        h = header_dict(msg.headers())
        assert msg.key() == b"tenant-x"
        assert h["llmq.dlq.source.topic"] == topic
        assert h["llmq.dlq.source.partition"] == "0"
        assert h["llmq.dlq.reason"] == reason, h
        assert h["llmq.dlq.error"]
        assert ("from", b"test") in msg.headers()  # the producer's own headers are kept
    offsets = sorted(int(header_dict(m.headers())["llmq.dlq.source.offset"]) for m in letters)
    assert offsets == [0, 1, 2, 3]
    # The garbage did not stall the partition: everything, including it, is committed.
    committed = committed_offsets(settings.kafka.bootstrap, settings.worker.group_id, [topic])
    assert committed[(topic, 0)] == 5


def test_expired_requests_are_answered_without_calling_the_model(settings):
    import time

    with running_worker(settings), LlmqClient(settings) as client:
        stale = Request.new("tenant-late", "too late", timeout_ms=1000)
        stale.created_at = int(time.time() * 1000) - 5000
        client.submit(stale)
        resp = client.result(stale.request_id, timeout=30)
    assert resp.status is Status.EXPIRED
    assert resp.reason.startswith("deadline_passed")
    assert resp.output is None


def test_the_callers_trace_id_comes_back_in_response_metadata(settings):
    with running_worker(settings), LlmqClient(settings) as client:
        req = Request.new("tenant-traced", "follow me", trace_id="4bf92f3577b34da6a3ce929d0e0e4736")
        resp = client.submit_and_wait(req, timeout=30)
    assert resp.metadata.get("trace_id") == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_invalid_requests_are_rejected_with_a_reason_and_counted(settings):
    with running_worker(settings) as worker, LlmqClient(settings) as client:
        bad = Request.new("tenant-bad", "hello", max_tokens=0)
        good = Request.new("tenant-good", "hello")
        client.submit(bad)
        client.submit(good)
        bad_resp = client.result(bad.request_id, timeout=30)
        assert client.result(good.request_id, timeout=30).status is Status.COMPLETED
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for m in worker.metrics.registry.collect() for s in m.samples}
    assert bad_resp.status is Status.REJECTED
    assert bad_resp.reason.startswith("invalid_request: max_tokens")
    assert samples[("llmq_rejections_total", (("priority", "NORMAL"), ("reason", "invalid_request")))] == 1
    assert samples[("llmq_requests_total", (("outcome", "completed"), ("priority", "NORMAL")))] == 1


def test_a_pool_consumes_only_its_bands_in_its_own_group(settings):
    from pipeline.errors import RequestTimeoutError

    settings.worker.pool = "realtime"
    settings.worker.group_id = "llmq-workers"  # the default: the pool picks llmq-pool-realtime
    with running_worker(settings) as worker, LlmqClient(settings) as client:
        assert worker.group_id == "llmq-pool-realtime"
        urgent = Request.new("tenant-a", "now", priority=Priority.CRITICAL)
        later = Request.new("tenant-a", "whenever", priority=Priority.LOW)
        client.submit(urgent)
        client.submit(later)
        assert client.result(urgent.request_id, timeout=30).status is Status.COMPLETED
        with pytest.raises(RequestTimeoutError):
            client.result(later.request_id, timeout=3)


def test_a_resubmitted_request_id_is_given_the_first_answer_again(settings):
    from tests.integration.harness import read_topic

    with running_worker(settings), LlmqClient(settings) as client:
        req = Request.new("tenant-twice", "only once please")
        client.submit(req)
        first = client.result(req.request_id, timeout=30)
        client.submit(req)
        responses = read_topic(settings.kafka.bootstrap, settings.topics.responses, timeout=30,
                               until=lambda ms: len(ms) >= 2)
    assert first.status is Status.COMPLETED
    assert len(responses) == 2 and responses[0].value() == responses[1].value()
    assert Codec.default().decode_response(responses[1].value()) == first


def test_the_openai_http_backend_serves_through_the_worker_and_failures_end_failed(settings):
    from pipeline.worker.backends.factory import make_backend
    from tests.openai_stub import StubServer

    script = [(429, {"error": "rate"}, 0, {"retry-after": "0.1"}), (200, None, 0, {})]
    with StubServer(script) as server:
        settings.worker.backend = "openai"
        settings.worker.openai_base_url = server.url
        settings.worker.backend_max_attempts = 2
        with running_worker(settings, make_backend(settings.worker)), LlmqClient(settings) as client:
            ok = client.submit_and_wait(Request.new("tenant-http", "via http", max_tokens=8), timeout=30)
            server.script = [(503, {"error": "down"}, 0, {})]
            bad = client.submit_and_wait(Request.new("tenant-http", "will fail"), timeout=30)
    assert ok.status is Status.COMPLETED and ok.output == "echo: via http"
    assert (ok.prompt_tokens, ok.completion_tokens) == (7, 3)
    assert bad.status is Status.FAILED
    assert bad.reason.startswith("backend_error: HTTP 503") and "after 2 attempts" in bad.reason


def test_cancelled_requests_are_answered_cancelled_queued_or_in_flight(settings):
    import time

    from pipeline.worker.backends.simulated import SimulatedBackend

    settings.worker.max_inflight = 1
    # A model call far longer than the cancellation takes, so that "cut short" is unmistakable
    # on a loaded machine (a 3 s call left 2.2 s of margin, and a full suite once needed 2.15 s).
    with running_worker(settings, SimulatedBackend(latency_ms=6000)) as worker, LlmqClient(settings) as client:
        time.sleep(3)  # joined, cancellation view caught up
        running = Request.new("tenant-c", "long one")
        queued = Request.new("tenant-c", "behind it")
        client.submit(running)
        client.submit(queued)
        time.sleep(0.8)  # `running` is in the model, `queued` waits for the single slot
        started = time.monotonic()
        client.cancel(running.request_id, "user closed the tab")
        client.cancel(queued.request_id)
        first = client.result(running.request_id, timeout=10)
        elapsed = time.monotonic() - started
        second = client.result(queued.request_id, timeout=10)
        assert worker.stats.cancelled == 2
    assert first.status is Status.CANCELLED and first.reason == "cancelled: user closed the tab"
    assert elapsed < 4.0  # the 6 s model call (5.2 s of it left) was cut short
    assert second.status is Status.CANCELLED and second.output is None


def test_exactly_once_mode_publishes_each_response_once_with_its_offsets(settings):
    from tests.integration.harness import read_topic

    settings.worker.delivery = "exactly-once"
    settings.worker.max_inflight = 16
    from pipeline.worker.backends.simulated import SimulatedBackend

    reqs = [Request.new(f"tenant-{i % 4}", f"eos {i}", priority=list(Priority)[i % 5]) for i in range(300)]
    with LlmqClient(settings, listen=False) as client:
        for fut in [client.submit_nowait(r, track=False) for r in reqs]:
            fut.result(30)
    with running_worker(settings, SimulatedBackend(latency_ms=5)) as worker:
        msgs = read_topic(settings.kafka.bootstrap, settings.topics.responses, timeout=60,
                          until=lambda ms: len(ms) >= len(reqs))
        assert worker.stats.commits >= 1
    ids = [Codec.default().decode_response(m.value()).request_id for m in msgs]
    assert sorted(ids) == sorted(r.request_id for r in reqs)  # read_committed: each exactly once
    topics = settings.topics.request_topics
    committed = committed_offsets(settings.kafka.bootstrap, settings.worker.group_id, topics)
    for tp, end in end_offsets(settings.kafka.bootstrap, topics).items():
        if end:
            assert committed[tp] == end
