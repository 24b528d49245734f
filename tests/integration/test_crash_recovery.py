"""A worker killed with SIGKILL mid-load loses nothing; SIGTERM drains and commits."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

from pipeline.client import LlmqClient
from pipeline.models import Priority, Request
from pipeline.serde import Codec
from tests.integration.harness import committed_offsets, end_offsets, read_topic


def _worker(settings, *extra: str) -> subprocess.Popen:
    env = {**os.environ,
           "LLMQ_BOOTSTRAP": settings.kafka.bootstrap,
           "LLMQ_TOPICS__PREFIX": settings.topics.prefix,
           "LLMQ_WORKER__GROUP_ID": settings.worker.group_id,
           "LLMQ_WORKER__COMMIT_INTERVAL_MS": "200",
           "LLMQ_WORKER__METRICS_PORT": "0",
           # the killed worker's partitions move after this, not after the 45 s default
           "LLMQ_WORKER__SESSION_TIMEOUT_MS": "6000"}
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "--log-level",
                             os.environ.get("LLMQ_TEST_WORKER_LOG", "WARNING"), "worker", *extra],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE,
                            text=True)


def _answers(settings, until=None, timeout=60.0) -> list[tuple[str, str]]:
    """(request id, status) of every answer in the response topic, in the order read."""
    codec = Codec.default()
    msgs = read_topic(settings.kafka.bootstrap, settings.topics.responses, timeout=timeout,
                      until=(lambda ms: until(len(ms))) if until else None)
    return [(r.request_id, r.status.value) for r in map(codec.decode_response, (m.value() for m in msgs))]


def _response_ids(settings, until=None, timeout=60.0) -> list[str]:
    return [rid for rid, _ in _answers(settings, until, timeout)]


def _kill_mid_load(settings, reqs: list, args: tuple, kill_after: int, timeout: float = 180.0,
                   settle_s: float = 2.0) -> tuple[int, int, int]:
    """Submit ``reqs``, start a worker with ``args``, SIGKILL it once ``kill_after`` answers
    are out, start it again and wait for every answer: (answered before the kill, missing,
    duplicates). Every request here is valid and the model works, so an answer counts as
    delivered only when it is COMPLETED: any other status fails the test."""
    with LlmqClient(settings, listen=False) as client:
        for fut in [client.submit_nowait(r, track=False) for r in reqs]:
            fut.result(60)
    worker = _worker(settings, *args)
    _response_ids(settings, until=lambda n: n >= kill_after, timeout=timeout)
    worker.send_signal(signal.SIGKILL)
    worker.wait(10)
    killed_at = len(_response_ids(settings, timeout=5))
    # (exactly-once: the same worker id is the same transactional id, so the new producer
    # fences the old one and aborts its open transaction at once)
    restarted = _worker(settings, *args)
    try:
        _response_ids(settings, timeout=timeout, until=lambda n: n >= len(reqs))
        time.sleep(settle_s)  # a straggler duplicate gets a moment to show up
        answers = _answers(settings)
    finally:
        restarted.send_signal(signal.SIGTERM)
        assert restarted.wait(30) == 0, restarted.stderr.read()
    wrong = collections.Counter(status for _, status in answers if status != "COMPLETED")
    assert not wrong, f"valid requests answered other than COMPLETED: {dict(wrong)}"
    counts = collections.Counter(rid for rid, _ in answers)
    missing = {r.request_id for r in reqs} - set(counts)
    return killed_at, len(missing), sum(c - 1 for c in counts.values())


def test_sigkill_mid_load_then_restart_answers_every_request(settings):
    total = 2000
    reqs = [Request.new(f"tenant-{i % 7}", f"request {i}", priority=list(Priority)[i % 5], max_tokens=8)
            for i in range(total)]
    # Killed once roughly a third of the responses are out: requests are in flight then.
    killed_at, missing, duplicates = _kill_mid_load(
        settings, reqs, ("--sim-latency-ms", "20", "--max-inflight", "16"), kill_after=total // 3, settle_s=1.0)
    print(f"\nkill -9 after {killed_at} of {total} responses: missing={missing} duplicates={duplicates}")
    assert not missing
    # At-least-once: duplicates are only the requests finished but not yet committed at the kill.
    assert duplicates < total // 2


def test_sigterm_finishes_in_flight_work_commits_and_exits_cleanly(settings):
    reqs = [Request.new("tenant-slow", f"slow {i}", priority=Priority.NORMAL) for i in range(10)]
    worker = _worker(settings, "--sim-latency-ms", "1500", "--max-inflight", "32")
    try:
        time.sleep(3)  # joined the group
        with LlmqClient(settings, listen=False) as client:
            for fut in [client.submit_nowait(r, track=False) for r in reqs]:
                fut.result(30)
        time.sleep(0.8)  # taken, not finished
    finally:
        worker.send_signal(signal.SIGTERM)
        rc = worker.wait(30)
    assert rc == 0, worker.stderr.read()
    ids = _response_ids(settings)
    assert sorted(ids) == sorted(r.request_id for r in reqs)
    topic = settings.topics.request_topic(Priority.NORMAL)
    committed = committed_offsets(settings.kafka.bootstrap, settings.worker.group_id, [topic])
    for tp, end in end_offsets(settings.kafka.bootstrap, [topic]).items():
        if end:
            assert committed[tp] == end


def test_a_model_call_longer_than_max_poll_interval_neither_evicts_nor_redelivers(settings):
    from pipeline.worker.backends.simulated import SimulatedBackend
    from tests.integration.harness import running_worker

    settings.worker.max_poll_interval_ms = 10_000
    settings.worker.session_timeout_ms = 6_000
    with running_worker(settings, SimulatedBackend(latency_ms=15_000)) as worker, LlmqClient(settings) as client:
        req = Request.new("tenant-slow", "think hard", timeout_ms=120_000)
        client.submit(req)
        resp = client.result(req.request_id, timeout=40)
        assert resp.status.value == "COMPLETED"
        time.sleep(1)
        ids = _response_ids(settings)
        rebalances = worker.stats.rebalances
    assert ids == [req.request_id]  # answered once: no eviction, no redelivery
    assert rebalances == 1  # the initial assignment only


def test_exactly_once_mode_sigkill_mid_load_then_restart_has_no_loss_and_no_duplicates(settings):
    total = 2000
    reqs = [Request.new(f"tenant-{i % 7}", f"eos {i}", priority=list(Priority)[i % 5], max_tokens=8,
                        timeout_ms=600_000) for i in range(total)]
    args = ("--delivery", "exactly-once", "--worker-id", "eos-worker", "--sim-latency-ms", "20", "--max-inflight", "16")
    killed_at, missing, duplicates = _kill_mid_load(settings, reqs, args, kill_after=total // 3)
    print(f"\nexactly-once, kill -9 at a third of {total}: missing={missing} duplicates={duplicates}")
    assert not missing
    assert duplicates == 0


def test_after_a_kill_the_requests_finished_behind_a_slow_one_are_not_answered_again(settings):
    """A slow request at a partition's head holds its commit position; the commit metadata
    lists what finished behind it, so a restarted worker redoes only the slow one."""
    from pipeline.worker.backends.simulated import LATENCY_METADATA_KEY

    def req(prompt, **metadata):
        # one tenant and band: one partition, in this order
        return Request.new("tenant-hol", prompt, priority=Priority.NORMAL, max_tokens=4, timeout_ms=600_000,
                           metadata=metadata)

    slow = req("slow head", **{LATENCY_METADATA_KEY: "8000"})
    fast = [req(f"fast {i}") for i in range(300)]
    with LlmqClient(settings, listen=False) as client:
        for r in [slow, *fast]:
            client.submit(r)
    worker = _worker(settings, "--sim-latency-ms", "2", "--max-inflight", "16")
    _response_ids(settings, until=lambda n: n >= len(fast), timeout=60)
    time.sleep(1.5)  # several commit intervals: the list of finished offsets is committed
    worker.send_signal(signal.SIGKILL)
    worker.wait(10)
    assert slow.request_id not in _response_ids(settings)  # still in flight at the kill
    restarted = _worker(settings, "--sim-latency-ms", "2", "--max-inflight", "16")
    try:
        _response_ids(settings, until=lambda n: n >= len(fast) + 1, timeout=60)
        time.sleep(1)
        ids = _response_ids(settings)
    finally:
        restarted.send_signal(signal.SIGTERM)
        assert restarted.wait(30) == 0, restarted.stderr.read()
    counts = collections.Counter(ids)
    duplicates = sum(c - 1 for c in counts.values())
    print(f"\nkill -9 with a slow head and 300 finished behind it: duplicates={duplicates}")
    assert set(counts) == {slow.request_id, *(r.request_id for r in fast)}
    assert duplicates == 0


def _zero_latency_kill(settings, *args: str, total: int) -> tuple[int, int, int]:
    """A worker with a 0-ms model (commits at their fastest) killed as soon as its first answers are out."""
    reqs = [Request.new(f"tenant-{i % 50}", f"zero {i}", priority=Priority.NORMAL, max_tokens=8, timeout_ms=600_000)
            for i in range(total)]
    return _kill_mid_load(settings, reqs, (*args, "--sim-latency-ms", "0"), kill_after=1)


def test_zero_latency_sigkill_mid_load_then_restart_answers_every_request(settings):
    total = 30_000
    killed_at, missing, duplicates = _zero_latency_kill(settings, total=total)
    print(f"\n0-ms model, kill -9 after {killed_at} of {total} responses: missing={missing} duplicates={duplicates}")
    assert killed_at < total  # the kill landed mid-load
    assert missing == 0


def test_zero_latency_exactly_once_sigkill_mid_load_has_no_loss_and_no_duplicates(settings):
    total = 30_000
    killed_at, missing, duplicates = _zero_latency_kill(
        settings, "--delivery", "exactly-once", "--worker-id", "zero-eos", total=total)
    print(f"\n0-ms model exactly-once, kill -9 after {killed_at} of {total}: missing={missing} duplicates={duplicates}")
    assert killed_at < total
    assert missing == 0 and duplicates == 0
