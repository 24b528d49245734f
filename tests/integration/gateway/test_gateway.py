"""The gateway through the real broker: admission, every kind of refusal, restarts keep the limits."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from confluent_kafka import Producer

from pipeline.client import LlmqClient
from pipeline.dlq import H_REASON
from pipeline.models import Priority, Request, Status
from pipeline.serde import Codec
from pipeline.testing import produce_request
from tests.integration.harness import free_port, read_topic, running_worker

# A small gateway: a rate limit with a long window (tests run inside one window), tight quotas.
GATEWAY_TOML = """
[gateway]
web_port = 0
max_timeout_ms = 600000

[gateway.limits.long_window]
window_ms = 300000
requests = {requests}
over = "refuse"

[gateway.tenant_outstanding]
CRITICAL = 0
HIGH = 0
NORMAL = 0
LOW = 0
BACKGROUND = 0
"""


@contextlib.contextmanager
def running_gateway(settings, tmp_path: Path, *, requests_per_window: int = 1000, app_id: str | None = None,
                    env: dict[str, str] | None = None, toml: str | None = None):
    """``llmq gateway`` as a process (as deployed); stopped with SIGTERM on exit. ``toml``: its
    whole config file instead of the small one above."""
    config = tmp_path / f"gateway-{time.monotonic_ns()}.toml"
    config.write_text(toml if toml is not None else GATEWAY_TOML.format(requests=requests_per_window))
    app_id = app_id or f"{settings.topics.prefix}-gateway"
    log_path = tmp_path / f"gateway-{time.monotonic_ns()}.log"
    env = {**os.environ, "LLMQ_CONFIG": str(config), **settings.topology_env(), **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "--log-level", "INFO", "gateway",
                                 "--app-id", app_id], env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while "Worker]: Ready" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"gateway did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        print(log_path.read_text()[-2000:] if proc.returncode else "")


@pytest.fixture
def dispatch_settings(settings):
    settings.worker.source = "dispatch"
    return settings


def _responses(settings):
    codec = Codec.default()
    return [codec.decode_response(m.value()) for m in read_topic(settings.kafka.bootstrap, settings.topics.responses)]


def test_an_admitted_request_reaches_a_worker_with_its_admission_time_and_band(dispatch_settings, tmp_path):
    s = dispatch_settings
    with running_gateway(s, tmp_path), running_worker(s), LlmqClient(s) as client:
        req = Request.new("acme", "hello through the gateway", priority=Priority.HIGH)
        client.submit(req)
        resp = client.result(req.request_id, timeout=30)
    assert resp.status is Status.COMPLETED
    assert resp.admitted_at is not None and resp.created_at <= resp.admitted_at <= resp.started_at
    assert resp.served_priority is Priority.HIGH and resp.requested_priority is Priority.HIGH


def test_refusals_say_why_and_every_request_is_answered_once(dispatch_settings, tmp_path):
    s = dispatch_settings
    codec = Codec.default()
    limited = [Request.new("limited", f"r{i}", timeout_ms=600_000) for i in range(8)]
    empty_tenant = Request.new("", "no tenant")
    expired = Request.new("acme", "too late", created_at=int(time.time() * 1000) - 120_000, timeout_ms=60_000)
    cancelled = Request.new("acme", "never mind", timeout_ms=600_000)
    duplicate = Request.new("acme", "once only", timeout_ms=600_000)
    with running_gateway(s, tmp_path, requests_per_window=5), running_worker(s), LlmqClient(s) as client:
        client.cancel(cancelled.request_id, "changed my mind")
        time.sleep(1.0)  # the gateway polls cancellations every 0.2 s
        for r in [*limited, empty_tenant, expired, cancelled, duplicate, duplicate]:
            client.submit(r)
        producer = Producer(s.kafka.producer_config())
        producer.produce(s.topics.request_topic(Priority.NORMAL), b"\xc3\x01garbage", b"acme")
        producer.flush(10)
        answers = {r.request_id: client.result(r.request_id, timeout=30)
                   for r in [*limited, empty_tenant, expired, cancelled, duplicate]}
        time.sleep(1.5)
    statuses = collections.Counter(answers[r.request_id].status for r in limited)
    assert statuses == {Status.COMPLETED: 5, Status.REJECTED: 3}
    rejected = [answers[r.request_id] for r in limited if answers[r.request_id].status is Status.REJECTED]
    assert all(a.reason.startswith("rate_limited: limit long_window") and a.retry_after_ms > 0 for a in rejected)
    assert answers[empty_tenant.request_id].reason.startswith("invalid_request: tenant_id is empty")
    assert answers[expired.request_id].status is Status.EXPIRED
    assert answers[cancelled.request_id].status is Status.CANCELLED
    # Nothing dispatched for the refused ones; the duplicate id went out once.
    dispatched = [codec.decode_request(m.value()).request_id
                  for p in Priority for m in read_topic(s.kafka.bootstrap, s.topics.dispatch_topic(p))]
    admitted = {r.request_id for r in limited if answers[r.request_id].status is not Status.REJECTED}
    assert collections.Counter(dispatched) == collections.Counter([*admitted, duplicate.request_id])
    answered = collections.Counter(r.request_id for r in _responses(s))
    assert all(answered[rid] == 1 for rid in answered)  # the gateway answered nothing twice
    [dead] = read_topic(s.kafka.bootstrap, s.topics.dlq)
    assert dead.value() == b"\xc3\x01garbage"
    assert dict(dead.headers())[H_REASON] == b"truncated"


def test_the_rate_limit_holds_across_a_gateway_restart_in_the_middle_of_its_window(dispatch_settings, tmp_path):
    s = dispatch_settings
    window_s, limit = 300, 20
    if time.time() % window_s > window_s - 60:  # keep the whole test inside one window
        time.sleep(window_s - time.time() % window_s + 1)
    first = [Request.new("steady", f"a{i}", timeout_ms=600_000) for i in range(12)]
    second = [Request.new("steady", f"b{i}", timeout_ms=600_000) for i in range(15)]
    app_id = f"{s.topics.prefix}-gw"
    with LlmqClient(s) as client, running_worker(s):
        with running_gateway(s, tmp_path, requests_per_window=limit, app_id=app_id):
            for r in first:
                client.submit(r)
            before = [client.result(r.request_id, timeout=30) for r in first]
        # A new process: the counts come back from the changelog topics.
        with running_gateway(s, tmp_path, requests_per_window=limit, app_id=app_id):
            for r in second:
                client.submit(r)
            after = [client.result(r.request_id, timeout=30) for r in second]
    admitted_before = sum(a.status is not Status.REJECTED for a in before)
    admitted_after = sum(a.status is not Status.REJECTED for a in after)
    print(f"\nadmitted {admitted_before} before the restart, {admitted_after} after (limit {limit})")
    assert admitted_before == 12
    assert admitted_after == limit - 12
    assert all(a.reason.startswith("rate_limited") for a in after if a.status is Status.REJECTED)


def test_a_gateway_killed_mid_stream_loses_no_request_after_its_restart(dispatch_settings, tmp_path):
    # The gateway writes the state behind a decision before its outputs, and acknowledges a
    # request once they are delivered; faust commits what is acknowledged. Whatever a SIGKILL cuts
    # off is admitted again by the restarted gateway (at least once): a request whose decision was
    # written goes out as it did, the others are decided afresh. A worker answers an id it already
    # answered with the same bytes, so every request has COMPLETED answers only, all alike.
    s = dispatch_settings
    codec = Codec.default()
    reqs = [Request.new(f"tenant-{i % 7}", f"k{i}", timeout_ms=600_000, max_tokens=4) for i in range(600)]
    ids = {r.request_id for r in reqs}
    app_id = f"{s.topics.prefix}-gw"
    producer = Producer(s.kafka.producer_config())
    with running_worker(s):
        with running_gateway(s, tmp_path, app_id=app_id) as gateway:
            for i, r in enumerate(reqs[:400]):
                produce_request(producer, s, codec, r)
                if i % 40 == 39:
                    producer.flush(10)
                    time.sleep(0.05)
            producer.flush(10)
            # Answered means dispatched (to NORMAL, or LOW once the measured load is high).
            answered_before = len(read_topic(s.kafka.bootstrap, s.topics.responses,
                                             until=lambda ms: len(ms) >= 100, timeout=30))
            gateway.kill()
            gateway.wait(10)
        with running_gateway(s, tmp_path, app_id=app_id):
            for r in reqs[400:]:
                produce_request(producer, s, codec, r)
            producer.flush(10)

            def all_completed(ms):
                return ids <= {r.request_id for r in map(codec.decode_response, (m.value() for m in ms))
                               if r.status is Status.COMPLETED}

            answered = [codec.decode_response(m.value())
                        for m in read_topic(s.kafka.bootstrap, s.topics.responses, timeout=120, until=all_completed)]
    completed = collections.Counter(r.request_id for r in answered if r.status is Status.COMPLETED)
    others = [r for r in answered if r.status is not Status.COMPLETED]
    distinct = collections.defaultdict(set)
    for r in answered:
        distinct[r.request_id].add((r.status, r.output))
    repeated = sum(n - 1 for n in completed.values())
    print(f"\nkilled after {answered_before} answers; completed {len(completed)} of {len(ids)}, "
          f"repeated answers {repeated}")
    assert set(completed) == ids and not others
    assert all(len(answers) == 1 for answers in distinct.values())  # a repeat is the same answer


def test_a_killed_gateway_restarted_under_its_instance_id_admits_again_within_seconds(dispatch_settings, tmp_path):
    # Static membership: the restarted member takes its partitions back at once instead of
    # waiting for the killed one's session (30 s here; faust's own default is 60 s) to expire.
    s = dispatch_settings
    codec = Codec.default()
    env = {"LLMQ_GATEWAY__INSTANCE_ID": "gateway-0", "LLMQ_GATEWAY__SESSION_TIMEOUT_MS": "30000"}
    app_id = f"{s.topics.prefix}-gw"
    producer = Producer(s.kafka.producer_config())
    dispatch = s.topics.dispatch_topic(Priority.NORMAL)

    def dispatched(req):
        def holds(ms):
            return req.request_id in {codec.decode_request(m.value()).request_id for m in ms}
        return holds

    before = Request.new("acme", "before the kill", timeout_ms=600_000)
    with running_gateway(s, tmp_path, app_id=app_id, env=env) as gateway:
        produce_request(producer, s, codec, before)
        producer.flush(10)
        assert dispatched(before)(read_topic(s.kafka.bootstrap, dispatch, until=dispatched(before), timeout=30))
        gateway.kill()
        gateway.wait(10)
    killed = time.monotonic()
    after = Request.new("acme", "after the restart", timeout_ms=600_000)
    with running_gateway(s, tmp_path, app_id=app_id, env=env):
        produce_request(producer, s, codec, after)
        producer.flush(10)
        assert dispatched(after)(read_topic(s.kafka.bootstrap, dispatch, until=dispatched(after), timeout=60))
        took = time.monotonic() - killed
    print(f"\nkilled gateway back and admitting {took:.1f} s after the kill (session timeout 30 s)")
    assert took < 20


def test_a_client_that_asks_is_told_its_queue_position_and_eta(dispatch_settings, tmp_path):
    s = dispatch_settings
    with running_gateway(s, tmp_path), LlmqClient(s) as client:
        req = Request.new("acme", "where am I", notify_queued=True, timeout_ms=600_000)
        client.submit(req)
        deadline = time.monotonic() + 30
        while client.queued(req.request_id) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        queued = client.queued(req.request_id)
    assert queued is not None and queued.status is Status.QUEUED
    assert queued.queue_position == 1 and queued.admitted_at is not None


def test_a_shadow_limit_is_counted_and_never_enforced(dispatch_settings, tmp_path):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    toml = GATEWAY_TOML.format(requests=1000).replace("web_port = 0", f"web_port = {port}")
    toml += "\n[gateway.shadow.limits.long_window]\nwindow_ms = 300000\nrequests = 2\nover = \"refuse\"\n"
    s = dispatch_settings
    reqs = [Request.new("trial", f"r{i}", timeout_ms=600_000) for i in range(6)]
    with running_gateway(s, tmp_path, toml=toml), running_worker(s), LlmqClient(s) as client:
        for r in reqs:
            client.submit(r)
        answers = [client.result(r.request_id, timeout=30) for r in reqs]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert [a.status for a in answers] == [Status.COMPLETED] * 6  # the real limit (1000) decides
    samples = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
               for fam in text_string_to_metric_families(text) for smp in fam.samples}
    shadow = "llmq_gateway_shadow_decisions_total"
    assert samples[(shadow, (("decision", "admitted"), ("reason", "none")))] == 2
    assert samples[(shadow, (("decision", "rejected"), ("reason", "rate_limited")))] == 4
    assert samples[("llmq_gateway_shadow_disagreements_total", (("real", "admitted"), ("shadow", "rejected")))] == 4
