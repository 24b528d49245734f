"""Exactly-once gateways: the one that owns the loaded tenants is SIGKILLed mid-load, the other
takes its partitions over, and a read_committed reader finds every request answered once.

All as deployed: two ``llmq gateway`` processes of one app id with
``gateway.processing_guarantee = "exactly-once"``, two ``llmq worker --source dispatch
--delivery exactly-once`` processes (simulated model), a real broker. The killed gateway's open
transaction (its outputs of requests decided but not committed) is aborted by the survivor's
producer of the same transactional id; the survivor redoes those requests from the committed
offsets, from the decisions in the ``seen`` table. Read afterwards, read_committed: no request
lost, none dispatched twice, none answered twice. Read read_uncommitted as well, the aborted
outputs show what the kill cut off.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from pipeline.models import Priority, Request
from pipeline.partitioning import tenant_partition
from pipeline.serde import Codec
from pipeline.testing import produce_request
from tests.integration.harness import LlmqProcess, committed_offsets, read_topic

REQUESTS = 3000
PER_S = 300.0
KILL_AFTER = 1200  # requests sent when the owner is killed
GATEWAY_SESSION_MS = 3_000
WORKER_SESSION_MS = 6_000

GATEWAY_TOML = """
[gateway]
web_port = 0
max_timeout_ms = 600000

[gateway.limits.generous]
window_ms = 1000
requests = 100000
"""


def _gateway(s, tmp: Path, i: int, app_id: str) -> LlmqProcess:
    workdir = tmp / f"gateway-{i}"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "gateway.toml").write_text(GATEWAY_TOML)
    env = {**os.environ, **s.topology_env(), "LLMQ_CONFIG": str(workdir / "gateway.toml"),
           "LLMQ_GATEWAY__PROCESSING_GUARANTEE": "exactly-once",
           "LLMQ_GATEWAY__SESSION_TIMEOUT_MS": str(GATEWAY_SESSION_MS)}
    argv = [sys.executable, "-m", "pipeline.cli", "--log-level", "INFO", "gateway", "--app-id", app_id,
            "--instance-id", f"gateway-{i}"]
    return LlmqProcess(f"gateway-{i}", argv, env, workdir, "Worker]: Ready")


def _worker(s, tmp: Path, i: int) -> LlmqProcess:
    env = {**os.environ, **s.topology_env(), "LLMQ_WORKER__SESSION_TIMEOUT_MS": str(WORKER_SESSION_MS),
           "LLMQ_WORKER__COMMIT_INTERVAL_MS": "200", "LLMQ_WORKER__METRICS_PORT": "0"}
    argv = [sys.executable, "-m", "pipeline.cli", "--log-level", "INFO", "worker", "--source", "dispatch",
            "--delivery", "exactly-once", "--worker-id", f"eos-w{i}", "--sim-latency-ms", "5",
            "--max-inflight", "32"]
    return LlmqProcess(f"worker-{i}", argv, env, tmp / "workers", None)


def _request_partitions(admin: AdminClient, group: str) -> dict[str, set[int]]:
    """Gateway instance id → the request partition numbers it holds."""
    members = admin.describe_consumer_groups([group], request_timeout=10)[group].result().members
    return {m.group_instance_id: {tp.partition for tp in m.assignment.topic_partitions if ".requests." in tp.topic}
            for m in members if m.assignment}


def _wait_split(admin: AdminClient, group: str, timeout: float = 60.0) -> dict[str, set[int]]:
    """Until both gateways hold request partitions."""
    deadline = time.monotonic() + timeout
    while True:
        held = _request_partitions(admin, group)
        if len(held) == 2 and all(held.values()):
            return held
        assert time.monotonic() < deadline, f"the gateways did not share the request partitions: {held}"
        time.sleep(0.2)


def _tenants_in(partitions: set[int], n: int, count: int) -> list[str]:
    tenants, i = [], 0
    while len(tenants) < count:
        name = f"eos-tenant-{i}"
        if tenant_partition(name.encode(), n) in partitions:
            tenants.append(name)
        i += 1
    return tenants


class Load(threading.Thread):
    def __init__(self, s, tenants: list[str]):
        super().__init__(name="load", daemon=True)
        self.s, self.tenants = s, tenants
        self.sent: list[Request] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        codec = Codec.default()
        producer = Producer(self.s.kafka.producer_config(**{"linger.ms": 2}))
        bands = (Priority.HIGH, Priority.NORMAL, Priority.LOW)
        t0 = time.monotonic()
        try:
            for i in range(REQUESTS):
                time.sleep(max(0.0, t0 + i / PER_S - time.monotonic()))
                req = Request.new(self.tenants[i % len(self.tenants)], f"eos {i}", priority=bands[i % len(bands)],
                                  max_tokens=4, timeout_ms=600_000)
                produce_request(producer, self.s, codec, req)
                self.sent.append(req)
            assert producer.flush(30) == 0
        except BaseException as exc:  # noqa: BLE001 (raised in the test)
            self.error = exc


def _ids(s, topic: str, decode, isolation: str = "read_committed") -> collections.Counter:
    return collections.Counter(decode(m.value()).request_id
                               for m in read_topic(s.kafka.bootstrap, topic, isolation=isolation))


def _answers(s, codec, isolation: str = "read_committed") -> collections.Counter:
    """(request id, status) → how many records: a request has one answer per status it goes through."""
    return collections.Counter((r.request_id, r.status) for r in (
        codec.decode_response(m.value()) for m in read_topic(s.kafka.bootstrap, s.topics.responses,
                                                            isolation=isolation)))


def _decided_uncommitted(s, app_id: str, committed: dict[tuple[str, int], int], killed_ms: int) -> set[str]:
    """Request ids whose decision the victim wrote to the ``seen`` changelog while their record
    was past the group's committed offset: decided, and redone by the survivor from that decision."""
    ids = set()
    for m in read_topic(s.kafka.bootstrap, f"{app_id}-seen-changelog"):
        if m.timestamp()[1] > killed_ms:
            continue  # the survivor's
        try:
            entries = json.loads(m.value()) if m.value() else []
        except ValueError:
            continue
        for entry in entries if isinstance(entries, list) else ():
            if isinstance(entry, list) and len(entry) > 1 and isinstance(entry[1], str):
                topic, partition, offset = entry[1].rsplit(":", 2)
                if int(offset) >= committed.get((topic, int(partition)), 0):
                    ids.add(entry[0])
    return ids


def test_a_killed_exactly_once_gateway_leaves_no_duplicate_and_loses_nothing(settings, tmp_path):
    s = settings
    s.worker.source = "dispatch"
    codec = Codec.default()
    app_id = f"{s.topics.prefix}-gw"
    admin = AdminClient(s.kafka.admin_config())
    gateways = [_gateway(s, tmp_path, i, app_id) for i in range(2)]
    workers = [_worker(s, tmp_path, i) for i in range(2)]
    t_start = time.monotonic()
    codes = {}
    try:
        for p in (*gateways, *workers):
            p.start()
        for g in gateways:
            g.wait_ready()
        held = _wait_split(admin, app_id)
        victim_id = max(held, key=lambda g: len(held[g]))  # the one with the most partitions
        victim = next(g for g in gateways if g.name == victim_id)
        survivor = next(g for g in gateways if g is not victim)
        tenants = _tenants_in(held[victim_id], s.topics.request_partitions, 4)
        load = Load(s, tenants)
        load.start()
        while len(load.sent) < KILL_AFTER:
            assert load.is_alive(), load.error
            time.sleep(0.01)
        before = len(read_topic(s.kafka.bootstrap, s.topics.responses))  # answered (committed) at the kill
        killed_ms = int(time.time() * 1000)
        victim.kill()
        killed_at = time.monotonic()
        # The victim is gone and the survivor holds none of its partitions yet: where the group stands.
        at_kill = committed_offsets(s.kafka.bootstrap, app_id, s.topics.request_topics)
        load.join(60)
        assert load.error is None and len(load.sent) == REQUESTS
        want = {r.request_id for r in load.sent}

        deadline = time.monotonic() + 60
        while True:
            answered = {rid for rid, status in _answers(s, codec) if status.is_terminal}
            if want <= answered:
                break
            assert time.monotonic() < deadline, (
                f"{len(want - answered)} of {len(want)} requests not answered within 60 s of the load's end; "
                f"survivor's log: {survivor.output()[-3000:]}")
            time.sleep(1)
        drained_s = time.monotonic() - killed_at
        time.sleep(1)  # a late duplicate would show up by now
    finally:
        for p in (*gateways, *workers):
            codes[p.name] = p.stop()

    answers = _answers(s, codec)
    dispatched = collections.Counter()
    aborted_dispatches = 0
    for topic in s.topics.dispatch_topics:
        committed = _ids(s, topic, codec.decode_request)
        dispatched += committed
        aborted_dispatches += sum(_ids(s, topic, codec.decode_request, "read_uncommitted").values()) \
            - sum(committed.values())
    aborted_answers = sum(_answers(s, codec, "read_uncommitted").values()) - sum(answers.values())
    pending = _decided_uncommitted(s, app_id, at_kill, killed_ms)
    lost = want - {rid for rid, status in answers if status.is_terminal}
    answered_twice = {key: n for key, n in answers.items() if n > 1}
    statuses = collections.Counter(status.value for (rid, status) in answers if rid in want)
    dispatched_twice = {rid: n for rid, n in dispatched.items() if n > 1}
    print(f"\n{len(want)} requests from {len(tenants)} tenants on partitions {sorted(held[victim_id])} of "
          f"{victim_id} (killed after {KILL_AFTER} sent, {before} answered); all answered {drained_s:.1f} s after "
          f"the kill; read_committed: lost {len(lost)}, answered twice {len(answered_twice)}, dispatched twice "
          f"{len(dispatched_twice)}; statuses {dict(statuses)}; aborted (read_uncommitted only): {aborted_dispatches} dispatches, "
          f"{aborted_answers} answers; decided but uncommitted at the kill: {len(pending)}, each answered once: "
          f"{all(answers[(rid, status)] == 1 for rid, status in answers if rid in pending)}; test {time.monotonic() - t_start:.0f} s")
    assert not lost
    assert not answered_twice, list(answered_twice.items())[:5]
    assert not dispatched_twice, list(dispatched_twice.items())[:5]
    assert codes[survivor.name] == 0 and all(codes[w.name] == 0 for w in workers), codes
