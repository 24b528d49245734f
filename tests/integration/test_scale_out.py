"""Three gateways and two workers under load, each gateway SIGKILLed in turn, then a worker.

Everything runs as deployed: ``llmq gateway`` processes of one app id (static members, as the
StatefulSet runs them), ``llmq worker --source dispatch`` processes with the simulated model, a
real broker, real SIGKILLs, each killed process restarted as a supervisor would. Load comes from
several tenants over four bands, one of them over its rate limit. Afterwards, read from the topics:

* nothing lost: every request answered, with the status it deserves (COMPLETED, or for the
  rate-limited tenant REJECTED rate_limited), and no id with two different statuses;
* a repeated answer is the same bytes (a gateway that re-dispatches an id after a failover gets
  the first answer again, from the worker's memory or, on a worker that did not take the first
  copy, read back from the responses); in at-least-once mode only a request the killed worker
  had not committed may be run again, with the same answer but its own timestamps;
* exactly-once workers: no dispatched record answered twice (the gateways run at-least-once here:
  tests/integration/gateway/test_gateway_exactly_once.py and `make chaos` run them exactly-once);
* the rate-limited tenant's admissions, over all gateways and failovers, stay within
  ``burst + rate x interval`` over every interval.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from pipeline.models import Priority, Request, Response, Status
from pipeline.serde import Codec
from pipeline.testing import produce_request
from tests.integration.harness import LlmqProcess, committed_offsets, read_topic

BANDS = (Priority.CRITICAL, Priority.HIGH, Priority.NORMAL, Priority.LOW)
TENANTS = [f"tenant-{i}" for i in range(8)]
METERED = "metered"
RATE_PER_S, BURST = 4, 2
# The gateways' default session (the test broker allows classic groups 1 s); a worker's group
# (consumer protocol) may go down to 3 s on it.
GATEWAY_SESSION_MS = 3_000
#: Every tenant admitted again within this after a restarted gateway rejoined its group.
REJOIN_S = 15.0
WORKER_SESSION_MS = 6_000

GATEWAY_TOML = f"""
[gateway]
web_port = 0
max_timeout_ms = 600000

[gateway.limits.generous]
window_ms = 1000
requests = 100000

[gateway.tenant_limits.{METERED}.paced]
window_ms = 1000
requests = {RATE_PER_S}
burst = {BURST}
over = "refuse"
"""


def _env(s, **extra) -> dict[str, str]:
    return {**os.environ, **s.topology_env(), **extra}


def _gateway(s, tmp: Path, i: int, app_id: str) -> LlmqProcess:
    workdir = tmp / f"gateway-{i}"  # each its own working directory (state dir), as a pod has
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "gateway.toml").write_text(GATEWAY_TOML)
    env = _env(s, LLMQ_CONFIG=str(workdir / "gateway.toml"), LLMQ_GATEWAY__SESSION_TIMEOUT_MS=str(GATEWAY_SESSION_MS))
    argv = [sys.executable, "-m", "pipeline.cli", "--log-level", "INFO", "gateway", "--app-id", app_id,
            "--instance-id", f"gateway-{i}"]
    return LlmqProcess(f"gateway-{i}", argv, env, workdir, "Worker]: Ready")


def _worker(s, tmp: Path, i: int, delivery: str) -> LlmqProcess:
    env = _env(s, LLMQ_WORKER__SESSION_TIMEOUT_MS=str(WORKER_SESSION_MS), LLMQ_WORKER__COMMIT_INTERVAL_MS="200",
               LLMQ_WORKER__METRICS_PORT="0")
    # The same worker id after a restart: exactly-once, its transactional id fences the killed one.
    argv = [sys.executable, "-m", "pipeline.cli", "--log-level", "INFO", "worker", "--source", "dispatch",
            "--delivery", delivery, "--worker-id", f"scale-w{i}", "--sim-latency-ms", "20", "--max-inflight", "8"]
    return LlmqProcess(f"worker-{i}", argv, env, tmp / "workers", None)


class Load(threading.Thread):
    """Requests at a steady pace: the tenants round-robin over four bands, the metered tenant at
    three times its rate limit."""

    def __init__(self, s, per_s: float = 36.0):
        super().__init__(name="load", daemon=True)
        self.s, self.per_s = s, per_s
        self.sent: list[Request] = []
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        codec = Codec.default()
        producer = Producer(self.s.kafka.producer_config(**{"linger.ms": 2}))
        t0 = time.monotonic()
        i = 0
        try:
            while not self.halt.is_set():
                self.halt.wait(max(0.0, t0 + i / self.per_s - time.monotonic()))
                tenant = METERED if i % 3 == 0 else TENANTS[i % len(TENANTS)]
                req = Request.new(tenant, f"scale-out {i}", priority=BANDS[(i // 3) % len(BANDS)], max_tokens=6,
                                  timeout_ms=600_000)
                produce_request(producer, self.s, codec, req)
                self.sent.append(req)
                i += 1
            assert producer.flush(30) == 0
        except BaseException as exc:  # noqa: BLE001 (raised in the test by stop())
            self.error = exc

    def stop(self) -> None:
        self.halt.set()
        self.join(60)
        if self.error is not None:
            raise self.error


class Admissions(threading.Thread):
    """The latest admitted_at per tenant on the dispatch topics, as the gateways dispatch."""

    def __init__(self, s):
        super().__init__(name="admissions", daemon=True)
        self.s = s
        self.latest: dict[str, int] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        codec = Codec.default()
        consumer = Consumer({"bootstrap.servers": self.s.kafka.bootstrap, "group.id": f"watch-{uuid.uuid4().hex}",
                             "enable.auto.commit": False, "fetch.wait.max.ms": 20})
        parts = [TopicPartition(t, p, OFFSET_BEGINNING) for t in self.s.topics.dispatch_topics
                 for p in range(self.s.topics.dispatch_partitions)]
        consumer.assign(parts)
        try:
            while not self.halt.is_set():
                for m in consumer.consume(500, 0.1):
                    if m.error() is None:
                        req = codec.decode_request(m.value())
                        self.latest[req.tenant_id] = max(self.latest.get(req.tenant_id, 0), req.admitted_at)
        finally:
            consumer.close()

    def all_admitted_after(self, at_s: float, timeout: float) -> float:
        """Wait until every tenant has been admitted after ``at_s`` (epoch s); returns how long it took."""
        at_ms, started = at_s * 1000, time.monotonic()
        while any(self.latest.get(t, 0) <= at_ms for t in (*TENANTS, METERED)):
            late = sorted(t for t in (*TENANTS, METERED) if self.latest.get(t, 0) <= at_ms)
            assert time.monotonic() - started < timeout, f"not admitted again within {timeout:.0f} s: {late}"
            time.sleep(0.1)
        return time.monotonic() - started


def _holding_members(admin: AdminClient, group: str) -> int:
    members = admin.describe_consumer_groups([group], request_timeout=10)[group].result().members
    return sum(1 for m in members if m.assignment and any(".requests." in tp.topic
                                                         for tp in m.assignment.topic_partitions))


def _wait_members(admin: AdminClient, group: str, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _holding_members(admin, group) != n:
        assert time.monotonic() < deadline, f"{group} does not have {n} members holding request partitions"
        time.sleep(0.2)


def _run_faults(s, tmp: Path, delivery: str) -> tuple[list[Request], dict]:
    app_id = f"{s.topics.prefix}-gw"
    admin = AdminClient(s.kafka.admin_config())
    gateways = [_gateway(s, tmp, i, app_id) for i in range(3)]
    workers = [_worker(s, tmp, i, delivery) for i in range(2)]
    admissions, load = Admissions(s), Load(s)
    timeline: dict = {"gateway_takeover_s": [], "rejoin_readmitted_s": [], "worker_killed_at": None}
    try:
        for p in (*gateways, *workers):
            p.start()
        for g in gateways:
            g.wait_ready()
        _wait_members(admin, app_id, 3)
        admissions.start()
        load.start()
        admissions.all_admitted_after(time.time(), timeout=30)
        for g in gateways:
            killed = g.kill()
            # Its partitions go to the survivors once its session expires.
            timeline["gateway_takeover_s"].append(admissions.all_admitted_after(killed, timeout=max(20.0, 4 * GATEWAY_SESSION_MS / 1000)))
            g.start()
            g.wait_ready()
            _wait_members(admin, app_id, 3)
            # Every tenant admitted again soon after the gateway rejoined (its partitions moved back).
            timeline["rejoin_readmitted_s"].append(admissions.all_admitted_after(time.time(), timeout=REJOIN_S))
        victim = workers[0]
        timeline["worker_killed_at"] = victim.kill()
        victim.start()
        time.sleep(WORKER_SESSION_MS / 1000 + 4)  # the restarted worker serves again under load
    finally:
        load.stop()
        sent = load.sent
        try:
            _wait_answered(s, sent, timeout=90)
        finally:
            admissions.halt.set()
            admissions.join(30)
            codes = {p.name: p.stop() for p in (*gateways, *workers)}
    timeline["exit_codes"] = codes
    return sent, timeline


def _wait_answered(s, sent: list[Request], timeout: float) -> None:
    """Until every request has a terminal answer (or the time is up: the assertions then say what is missing)."""
    codec = Codec.default()
    want = {r.request_id for r in sent}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = {codec.decode_response(m.value()).request_id for m in read_topic(s.kafka.bootstrap, s.topics.responses)}
        if want <= got:
            return
        time.sleep(1)


def _differs_only_in_the_run(a, b) -> bool:
    """Two answers of one request that agree on everything but when and by whom it ran."""
    keep = ("request_id", "status", "reason", "output", "prompt_tokens", "completion_tokens", "model", "degraded",
            "requested_priority", "served_priority", "created_at", "admitted_at")
    return all(getattr(a, k) == getattr(b, k) for k in keep)


def _worst_excess(times_ms: list[int], interval_ms: float) -> float:
    """The most admissions over any interval beyond what its length allows at the rate
    (``count - length / interval``); a GCRA bucket keeps it within its burst."""
    times = sorted(times_ms)
    return max(((j - i + 1) - (times[j] - times[i]) / interval_ms
                for i in range(len(times)) for j in range(i, len(times))), default=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
def test_gateways_and_a_worker_killed_in_turn_lose_nothing_and_keep_the_rate_limit(settings, tmp_path, delivery):
    s = settings
    s.worker.source = "dispatch"
    codec = Codec.default()
    sent, timeline = _run_faults(s, tmp_path, delivery)
    print(f"\n{delivery}: {len(sent)} requests; survivors admitted every tenant again "
          f"{', '.join(f'{t:.1f}' for t in timeline['gateway_takeover_s'])} s after each gateway's SIGKILL, and "
          f"{', '.join(f'{t:.1f}' for t in timeline['rejoin_readmitted_s'])} s after each one rejoined")
    problems: list[str] = []  # every check is made, and every failure said at once
    if any(code != 0 for code in timeline["exit_codes"].values()):
        problems.append(f"processes did not stop cleanly: {timeline['exit_codes']}")

    answers = collections.defaultdict(list)  # request id → [(raw bytes, Response)]
    for m in read_topic(s.kafka.bootstrap, s.topics.responses):  # read_committed
        resp = codec.decode_response(m.value())
        answers[resp.request_id].append((m.value(), resp))
    dispatched = collections.defaultdict(list)  # request id → [Request as dispatched]
    for topic in s.topics.dispatch_topics:
        for m in read_topic(s.kafka.bootstrap, topic):
            req = codec.decode_request(m.value())
            dispatched[req.request_id].append(req)
    arrived = {}  # request id → its request record's timestamp: the clock of the gateway's buckets
    placed = {}  # request id → (topic, partition, offset) of its request record
    for topic in s.topics.request_topics:
        for m in read_topic(s.kafka.bootstrap, topic):
            rid = codec.decode_request(m.value()).request_id
            arrived[rid] = m.timestamp()[1]
            placed[rid] = (m.topic(), m.partition(), m.offset())

    # Nothing lost, and each answered with what it deserves, one status per id.
    lost = [r.request_id for r in sent if not answers[r.request_id]]
    if lost:
        sent_by_id = {r.request_id: r for r in sent}
        where = collections.Counter(
            ("dispatched" if rid in dispatched else "in a request topic" if rid in arrived else "nowhere",
             sent_by_id[rid].priority.value, sent_by_id[rid].tenant_id == METERED) for rid in lost)
        problems.append(f"{len(lost)} of {len(sent)} requests never answered; (where, band, metered): {dict(where)}")
        committed = committed_offsets(s.kafka.bootstrap, f"{s.topics.prefix}-gw", s.topics.request_topics)
        at = collections.defaultdict(list)
        for rid in lost:
            if rid in placed:
                topic, partition, offset = placed[rid]
                at[(topic.rsplit(".", 1)[1], partition, committed.get((topic, partition)))].append(offset)
        problems.append("lost records by (band, partition, the gateways' committed offset): "
                        + ", ".join(f"{k}: offsets {min(v)}..{max(v)} ({len(v)})" for k, v in sorted(at.items())))
    wrong, mixed = [], []
    for r in sent:
        statuses = {resp.status for _, resp in answers[r.request_id]}
        if len(statuses) > 1:
            mixed.append((r.request_id, sorted(st.value for st in statuses)))
        deserved = statuses <= {Status.COMPLETED} or (
            r.tenant_id == METERED and statuses == {Status.REJECTED}
            and all(resp.reason.startswith("rate_limited: limit paced") for _, resp in answers[r.request_id]))
        if answers[r.request_id] and not deserved:
            wrong.append((r.tenant_id, r.priority.value, [(resp.status.value, resp.reason) for _, resp in answers[r.request_id]]))
    if mixed:
        problems.append(f"{len(mixed)} ids answered with two statuses: {mixed[:3]}")
    if wrong:
        problems.append(f"{len(wrong)} requests not answered with the status they deserve: {wrong[:3]}")

    # A repeat is the first answer again, byte for byte (a copy dispatched again reaching the worker
    # that did not take the first reads the first answer back), except at-least-once a request the
    # killed worker had not committed, run again after its SIGKILL: the same answer with its own run's times.
    worker_killed_ms = timeline["worker_killed_at"] * 1000
    changed = []
    FIELDS = [f.name for f in dataclasses.fields(Response)]
    for rid, got in answers.items():
        if not got:
            continue  # never answered: counted as lost above
        first_bytes, first = got[0]
        for raw, resp in got[1:]:
            # Run again after the worker's SIGKILL: at-least-once a record it had not committed.
            rerun = (delivery == "at-least-once" and resp.status is Status.COMPLETED
                     and _differs_only_in_the_run(first, resp) and (resp.started_at or 0) > worker_killed_ms)
            if raw != first_bytes and not rerun:
                changed.append((first.status.value, {k: (getattr(first, k), getattr(resp, k))
                                                     for k in FIELDS if getattr(first, k) != getattr(resp, k)}))
    if changed:
        problems.append(f"{len(changed)} repeats differ from the first answer: {changed[:3]}")

    # Every admitted request was dispatched with one admission (a re-dispatch after a failover is
    # the recorded decision again), and exactly-once the workers answered no dispatched record twice.
    redecided = [rid for rid, copies in dispatched.items() if len({(c.admitted_at, c.effective_priority) for c in copies}) > 1]
    if redecided:
        problems.append(f"{len(redecided)} requests dispatched with two different admissions")
    if delivery == "exactly-once":
        extra = [(len(answers[rid]), len(copies)) for rid, copies in dispatched.items() if len(answers[rid]) > len(copies)]
        if extra:
            problems.append(f"{len(extra)} dispatched records answered more than once (answers, dispatches): {extra[:3]}")
    completed = {rid for rid, got in answers.items() if got and got[0][1].status is Status.COMPLETED}
    if not completed <= set(dispatched):
        problems.append("a COMPLETED answer to a request no gateway dispatched")

    # The rate-limited tenant, over every gateway it moved between, counted on the arrival clock
    # (each request record's timestamp): at most burst + rate x L admissions over any interval of
    # arrivals of length L, however the band topics were read and whichever gateway decided.
    interval_ms = 1000 / RATE_PER_S
    metered = [rid for rid, copies in dispatched.items() if copies[0].tenant_id == METERED]
    by_arrival = _worst_excess([arrived[rid] for rid in metered], interval_ms)
    by_admission = _worst_excess([dispatched[rid][0].admitted_at for rid in metered], interval_ms)
    span_s = (max(arrived[rid] for rid in metered) - min(arrived[rid] for rid in metered)) / 1000 if metered else 0
    print(f"{METERED}: {len(metered)} admitted over {span_s:.0f} s (limit {RATE_PER_S}/s, burst {BURST}); most "
          f"admissions over any interval beyond its length x rate: {by_arrival:.2f} by arrival, "
          f"{by_admission:.2f} by admitted_at")
    if by_arrival > BURST + 1e-6:
        problems.append(f"the rate-limited tenant was admitted {by_arrival:.2f} over its rate in an interval of "
                        f"arrivals (burst {BURST})")
    # ...and the limit was what refused it, not something else: it kept close to its rate.
    if len(metered) < 0.6 * RATE_PER_S * span_s:
        problems.append(f"the rate-limited tenant got {len(metered)} admissions in {span_s:.0f} s, far under its rate")
    assert not problems, "\n".join(problems)
