"""Failover: how long a tenant goes unadmitted when its gateway is SIGKILLed, and how long a killed
worker's partitions go unread.

``gateway_failover(settings, args)``: two or three ``llmq gateway`` processes (one app id) under a
steady load from many tenants; in turn, the gateway owning a tenant's request partition (asked of
the group coordinator) is SIGKILLed, and the time from the kill to that tenant's first admission on a
survivor (``admitted_at`` of its next dispatched request) is measured. The killed gateway is
restarted (under its instance id when static) and the group left to settle before the next kill.
Each kill is split into its phases from the survivor's log: until it was told to rejoin (the dead
member's session expiring, noticed at a heartbeat), the rebalance, the tables' recovery, and the
first admission after it.

``worker_failover(settings, args)``: two ``llmq worker --source dispatch`` processes (consumer group
protocol) under a steady load on the dispatch topics; one is SIGKILLed, and the time until another
consumes each of its partitions is measured. Then the static-membership trade-off: a static member
restarted at once gets its partitions back, but one that leaves for good (SIGTERM) holds them until
its session times out, where a dynamic member hands them over at once.

    python bench/failover_bench.py                         # its own broker; gateways and workers
    python bench/failover_bench.py gateway --gateways 3 --kills 5 --session-timeout-ms 3000 --static
    LLMQ_BENCH_BOOTSTRAP=127.0.0.1:9092 python bench/failover_bench.py worker

The broker bounds a classic group's session (every gateway is a Faust, i.e. classic, group member)
with ``group.min.session.timeout.ms``: Kafka's default is 6 s, ``llmq broker``'s (and so this
script's own broker's) 1 s; ``--broker-min-session-ms`` starts it with another value. Like a
gateway, the scenario asks for a session within the broker's bounds, and says the one it measured.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient  # noqa: E402

from pipeline.broker import LocalBroker, free_port  # noqa: E402
from pipeline.config import Settings  # noqa: E402
from pipeline.gateway.membership import (KAFKA_DEFAULT_BOUNDS_MS, broker_session_bounds, heartbeat_ms,  # noqa: E402
                                         session_within)
from pipeline.partitioning import tenant_partition  # noqa: E402
from pipeline.models import Priority, Request  # noqa: E402
from pipeline.serde import Codec  # noqa: E402
from pipeline.testing import produce_request  # noqa: E402
from pipeline.topics import create_pipeline_topics  # noqa: E402

GATEWAY_TOML = """
[gateway]
web_port = 0
max_timeout_ms = 600000
# Neither demotion nor degradation: the measure is when a request is admitted, not where to.
high_load = 10
degrade_load = 10

[gateway.limits.generous]
window_ms = 1000
requests = 100000

[gateway.tenant_outstanding]
CRITICAL = 0
HIGH = 0
NORMAL = 0
LOW = 0
BACKGROUND = 0
"""


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


# -- supervised processes ---------------------------------------------------------------------

_FAUST_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")
_MEMBER = re.compile(r"Joined group '[^']+' \(generation (\d+)\) with member_id (\S+)")


def log_time(line: str) -> float | None:
    """The epoch seconds of a Faust/aiokafka log line (local time, milliseconds), else None."""
    m = _FAUST_STAMP.match(line)
    if not m:
        return None
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


class LlmqProcess:
    """An llmq process as a supervisor runs it: started, SIGKILLed, restarted with the same
    arguments and environment (a pod's), its output appended to one log."""

    ready_marker: str | None = None

    def __init__(self, name: str, argv: list[str], env: dict[str, str], workdir: Path):
        self.name = name
        self.argv = argv
        self.env = env
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0  # epoch s of the last start
        self._log_offset = 0  # where the last start's output begins
        self.starts = 0

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            log.write(f"--- start {time.strftime('%H:%M:%S')}\n")
            log.flush()
            self._log_offset = log.tell()
            self.started_at = time.time()
            self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=self.workdir)
        self.starts += 1

    def output(self) -> str:
        """What the current run has written so far."""
        with open(self.log_path, errors="replace") as f:
            f.seek(self._log_offset)
            return f.read()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while self.ready_marker is not None and self.ready_marker not in self.output():
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start: {self.output()[-3000:]}")
            time.sleep(0.1)

    def kill(self) -> float:
        """SIGKILL; returns the epoch second it was sent. A process that is not running is a
        fault that did not happen: raised, never passed over."""
        if not self.alive():
            raise RuntimeError(f"{self.name} was not running when it was to be killed "
                               f"(exit code {None if self.proc is None else self.proc.returncode})")
        at = time.time()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.returncode != -signal.SIGKILL:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}, not by the SIGKILL")
        return at

    def terminate(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (drain, commit, leave); SIGKILL after ``timeout``. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


class GatewayProcess(LlmqProcess):
    """``llmq gateway --app-id <app_id>`` in a working directory of its own (as a pod has)."""

    ready_marker = "Worker]: Ready"

    def __init__(self, name: str, settings: Settings, config: str, workdir: Path, app_id: str, *,
                 instance_id: str | None = None, env: dict[str, str] | None = None):
        workdir.mkdir(parents=True, exist_ok=True)
        cfg = workdir / "gateway.toml"
        cfg.write_text(config)
        full_env = {**os.environ, "LLMQ_CONFIG": str(cfg), **settings.topology_env(), **(env or {})}
        argv = [sys.executable, "-m", "pipeline.cli", "--log-level", "INFO", "gateway", "--app-id", app_id]
        if instance_id:
            argv += ["--instance-id", instance_id]
        super().__init__(name, argv, full_env, workdir)
        self.instance_id = instance_id

    def member_id(self) -> str | None:
        """The group member id of the current run (its last join)."""
        found = _MEMBER.findall(self.output())
        return found[-1][1] if found else None

    def events_after(self, after: float) -> dict[str, float]:
        """When, after epoch second ``after``, this gateway was first told to rejoin, joined,
        finished recovering its active tables, and (standbys read up to date, streams sought)
        was ready to process."""
        out: dict[str, float] = {}
        for line in self.output().splitlines():
            at = log_time(line)
            if at is None or at < after:
                continue
            if "(Re-)joining group" in line:
                out.setdefault("rejoining", at)
            elif "Joined group" in line:
                out.setdefault("joined", at)
            elif "Recovery complete" in line and "joined" in out:
                out.setdefault("recovered", at)
            elif "Worker ready" in line and "recovered" in out:
                out.setdefault("ready", at)
        return out


class WorkerProcess(LlmqProcess):
    """``llmq worker --source dispatch`` with the simulated model."""

    ready_marker = None

    def __init__(self, name: str, settings: Settings, workdir: Path, *, worker_id: str, latency_ms: float = 5,
                 inflight: int = 16, delivery: str = "at-least-once", env: dict[str, str] | None = None,
                 log_level: str = "INFO"):
        full_env = {**os.environ, **settings.topology_env(), "LLMQ_WORKER__METRICS_PORT": "0",
                    "LLMQ_WORKER__COMMIT_INTERVAL_MS": "200", **(env or {})}
        argv = [sys.executable, "-m", "pipeline.cli", "--log-level", log_level, "worker", "--source", "dispatch",
                "--worker-id", worker_id, "--delivery", delivery, "--sim-latency-ms", str(latency_ms),
                "--max-inflight", str(inflight)]
        super().__init__(name, argv, full_env, workdir)
        self.worker_id = worker_id


# -- load and observation ---------------------------------------------------------------------


class PacedLoad(threading.Thread):
    """Requests at ``rate`` per second, round-robin over ``tenants``, until stopped."""

    def __init__(self, settings: Settings, tenants: list[str], rate: float, *, priority=Priority.NORMAL,
                 topic_for=None, prepare=None):
        super().__init__(name="paced-load", daemon=True)
        self.settings = settings
        self.tenants = tenants
        self.rate = rate
        self.priority = priority
        self.topic_for = topic_for  # request → topic (default: its band's request topic)
        self.prepare = prepare  # request → None, before it is written
        self.sent: list[Request] = []
        self._stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        codec = Codec.default()
        producer = Producer(self.settings.kafka.producer_config(**{"linger.ms": 2}))
        t0 = time.monotonic()
        i = 0
        try:
            while not self._stop_event.is_set():
                delay = t0 + i / self.rate - time.monotonic()
                if delay > 0:
                    self._stop_event.wait(delay)
                tenant = self.tenants[i % len(self.tenants)]
                req = Request.new(tenant, f"steady {i}", priority=self.priority, max_tokens=4, timeout_ms=600_000)
                if self.prepare is not None:
                    self.prepare(req)
                topic = self.topic_for(req) if self.topic_for else None
                produce_request(producer, self.settings, codec, req, topic)
                self.sent.append(req)
                i += 1
            if producer.flush(30):
                raise RuntimeError("load requests left undelivered after 30 s")
        except BaseException as exc:  # noqa: BLE001 (said by the caller, not lost in the thread)
            self.error = exc

    def stop(self) -> None:
        self._stop_event.set()
        self.join(60)
        if self.error is not None:
            raise self.error


class TopicWatch(threading.Thread):
    """Reads ``topics`` from their beginning and hands each decoded value to ``on_value``."""

    def __init__(self, settings: Settings, topics: list[str], decode, on_value, *, isolation="read_committed"):
        super().__init__(name="topic-watch", daemon=True)
        self.settings = settings
        self.topics = topics
        self.decode = decode
        self.on_value = on_value
        self.isolation = isolation
        self._stop_event = threading.Event()
        self.read = 0

    def run(self) -> None:
        consumer = Consumer({"bootstrap.servers": self.settings.kafka.bootstrap,
                             "group.id": f"watch-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
                             "isolation.level": self.isolation, "fetch.wait.max.ms": 20})
        parts = []
        for topic in self.topics:
            md = consumer.list_topics(topic, timeout=30).topics[topic]
            parts += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.partitions]
        consumer.assign(parts)
        try:
            while not self._stop_event.is_set():
                for msg in consumer.consume(1000, 0.05):
                    if msg.error() is None:
                        self.on_value(msg, self.decode(msg.value()))
                        self.read += 1
        finally:
            consumer.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)


def group_members(admin: AdminClient, group: str) -> list:
    return admin.describe_consumer_groups([group], request_timeout=10)[group].result().members


def partition_owner(admin: AdminClient, group: str, topic: str, partition: int) -> str | None:
    """The member id that holds ``topic[partition]`` in ``group`` now, if any."""
    for member in group_members(admin, group):
        assignment = member.assignment.topic_partitions if member.assignment else []
        if any(tp.topic == topic and tp.partition == partition for tp in assignment):
            return member.member_id
    return None


def _fresh(settings: Settings, tag: str) -> Settings:
    s = Settings.load(env={})
    s.kafka.bootstrap = settings.kafka.bootstrap
    s.topics.prefix = f"{tag}{uuid.uuid4().hex[:6]}.llm"
    s.worker.group_id = f"{s.topics.prefix}.workers"
    s.worker.source = "dispatch"
    create_pipeline_topics(s)
    return s


# -- gateway failover -------------------------------------------------------------------------


def gateway_failover(settings: Settings, args) -> dict:
    """Seconds from a gateway's SIGKILL to the first admission of a tenant it owned on a survivor;
    ``median_s`` over ``args.kills`` kills (at least 3)."""
    gateways_n = getattr(args, "gateways", 3)
    kills = max(3, getattr(args, "kills", 3))
    static = getattr(args, "static", False)
    rate = getattr(args, "rate", 60.0)
    extra_env = dict(getattr(args, "gateway_env", None) or {})
    s = _fresh(settings, "gwf")
    admin = AdminClient(s.kafka.admin_config())
    # As each gateway will: the session asked for, within the broker's bounds.
    bounds = broker_session_bounds(admin) or KAFKA_DEFAULT_BOUNDS_MS
    floor = bounds.low_ms
    asked = getattr(args, "session_timeout_ms", None) or s.gateway.session_timeout_ms
    session_ms = session_within(asked, bounds)
    if session_ms != asked:
        _log(f"gateway_failover: the broker allows sessions of {bounds.low_ms} to {bounds.high_ms} ms; measuring with a "
             f"{session_ms}-ms session instead of {asked}")
    env = {"LLMQ_GATEWAY__SESSION_TIMEOUT_MS": str(session_ms), **extra_env}
    app_id = f"{s.topics.prefix}-gw"
    tenants = [f"tenant-{i:02d}" for i in range(4 * s.topics.request_partitions)]
    codec = Codec.default()
    admitted: dict[str, list[int]] = collections.defaultdict(list)
    lock = threading.Lock()

    def on_dispatch(msg, req) -> None:
        with lock:
            admitted[req.tenant_id].append(req.admitted_at)

    results = []
    with tempfile.TemporaryDirectory(prefix="llmq-failover-") as tmp:
        fleet = [GatewayProcess(f"gw{i}", s, GATEWAY_TOML, Path(tmp) / f"gw{i}", app_id,
                                instance_id=f"gw-{i}" if static else None, env=env) for i in range(gateways_n)]
        watch = TopicWatch(s, s.topics.dispatch_topics, codec.decode_request, on_dispatch)
        load = PacedLoad(s, tenants, rate)
        try:
            for g in fleet:
                g.start()
            for g in fleet:
                g.wait_ready()
            watch.start()
            load.start()
            _wait_stable(admin, app_id, fleet, timeout=60)
            time.sleep(3)
            topic = s.topics.request_topic(Priority.NORMAL)
            for k in range(kills):
                victim = fleet[k % len(fleet)]
                member = victim.member_id()
                owned = [t for t in tenants
                         if partition_owner(admin, app_id, topic, tenant_partition(t.encode(), s.topics.request_partitions))
                         == member]
                if not owned:
                    raise RuntimeError(f"{victim.name} ({member}) owns no NORMAL request partition")
                tenant = owned[0]
                partition = tenant_partition(tenant.encode(), s.topics.request_partitions)
                killed_at = victim.kill()
                kill_ms = int(killed_at * 1000)
                first = _first_admission_after(admitted, lock, tenant, kill_ms, timeout=max(60.0, 4 * session_ms / 1000))
                took = (first - kill_ms) / 1000.0
                new_owner = partition_owner(admin, app_id, topic, partition)
                survivor = next((g for g in fleet if g.alive() and g.member_id() == new_owner), None)
                phases = _phases(survivor, killed_at, first / 1000.0) if survivor else {}
                _log(f"  kill {k + 1}: {victim.name} (owning {topic}[{partition}], {tenant}); {tenant} admitted again "
                     f"by {survivor.name if survivor else new_owner} {took:.2f} s after the kill "
                     + " ".join(f"{p}={v:.2f}" for p, v in phases.items()))
                results.append({"victim": victim.name, "tenant": tenant, "partition": partition,
                                "took_s": round(took, 3), "survivor": survivor.name if survivor else new_owner,
                                "phases_s": phases})
                restart_at = time.time()
                victim.start()
                victim.wait_ready()
                _wait_stable(admin, app_id, fleet, timeout=90)
                results[-1]["rejoin_pause_s"] = _rejoin_pause(admitted, lock, tenants, restart_at)
                time.sleep(3)
        finally:
            load.stop()
            watch.stop()
            codes = {g.name: g.terminate() for g in fleet}
            _keep_logs(args, Path(tmp), "gateway")
    took = [r["took_s"] for r in results]
    return {"median_s": round(statistics.median(took), 3), "target_s": 5.0, "kills": len(results),
            "max_s": max(took), "min_s": min(took), "runs_s": took,
            "gateways": gateways_n, "static_membership": static,
            "session_timeout_ms": session_ms, "heartbeat_interval_ms": heartbeat_ms(session_ms),
            "broker_min_session_ms": floor, "load_per_s": rate, "tenants": len(tenants),
            "standby_replicas": int(extra_env.get("TABLE_STANDBY_REPLICAS", 1)), "faust_env": extra_env,
            "runs": results, "exit_codes": codes,
            "measured": "SIGKILL of the gateway owning a tenant's NORMAL request partition (asked of the group "
                        "coordinator) to the admitted_at of that tenant's first dispatched request after the "
                        "kill; phases from the survivor's log (told to rejoin, joined, tables recovered); "
                        "rejoin_pause_s: the longest any tenant went unadmitted while the killed gateway, "
                        "restarted, joined again"}


def _wait_stable(admin: AdminClient, group: str, fleet: list[GatewayProcess], timeout: float) -> None:
    """Until every running gateway is a member and holds request partitions."""
    deadline = time.monotonic() + timeout
    want = {g.member_id() for g in fleet if g.alive()}
    while time.monotonic() < deadline:
        want = {g.member_id() for g in fleet if g.alive()}
        members = group_members(admin, group)
        holding = {m.member_id for m in members
                   if m.assignment and any(".requests." in tp.topic for tp in m.assignment.topic_partitions)}
        if None not in want and want <= holding and len(members) == len(want):
            return
        time.sleep(0.2)
    raise RuntimeError(f"group {group} did not settle with {sorted(map(str, want))} within {timeout:.0f} s")


def _first_admission_after(admitted, lock, tenant: str, after_ms: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with lock:
            later = [a for a in admitted[tenant] if a > after_ms]
        if later:
            return min(later)
        time.sleep(0.05)
    raise RuntimeError(f"{tenant} was not admitted again within {timeout:.0f} s of the kill")


def _phases(survivor: GatewayProcess, killed_at: float, first_at: float) -> dict[str, float]:
    ev = survivor.events_after(killed_at)
    out = {}
    last = killed_at
    for name, key in (("until_rejoin", "rejoining"), ("rebalance", "joined"), ("recovery", "recovered"),
                      ("standbys", "ready")):
        if key in ev and ev[key] <= first_at:
            out[name] = round(ev[key] - last, 3)
            last = ev[key]
    out["to_first_admission"] = round(first_at - last, 3)
    return out


def _rejoin_pause(admitted, lock, tenants: list[str], since: float) -> float:
    """The longest gap between two admissions of one tenant since epoch second ``since``."""
    since_ms = since * 1000
    worst = 0.0
    with lock:
        for t in tenants:
            times = sorted(a for a in admitted[t] if a >= since_ms)
            worst = max([worst, *((b - a) / 1000.0 for a, b in zip(times, times[1:]))])
    return round(worst, 3)


def _keep_logs(args, tmp: Path, name: str) -> None:
    keep = getattr(args, "keep_logs", None)
    if keep:
        import shutil

        shutil.copytree(tmp, Path(keep) / name, dirs_exist_ok=True,
                        ignore=lambda d, names: [n for n in names if n.endswith(".toml")])


# -- worker failover --------------------------------------------------------------------------


def worker_failover(settings: Settings, args) -> dict:
    """A SIGKILLed worker's dispatch partitions consumed again by the other, dynamic membership; then
    a static member restarted at once, and a static and a dynamic member stopped for good."""
    session_ms = getattr(args, "worker_session_timeout_ms", None) or 6_000
    rate = getattr(args, "rate", 60.0)
    out = {"session_timeout_ms": session_ms, "group_protocol": "consumer", "load_per_s": rate}
    for case in ("dynamic_kill", "static_kill_restart", "static_sigterm", "dynamic_sigterm"):
        out[case] = _worker_case(settings, case, session_ms, rate, args)
    out["measured"] = ("seconds from the signal to the first response, for a request read from each partition the "
                       "stopped worker held, that another (or, restarted, the same) worker started after it; "
                       "first_s for its first partition, all_s once every one of them was consumed again")
    return out


def _worker_case(settings: Settings, case: str, session_ms: int, rate: float, args=None) -> dict:
    s = _fresh(settings, "wkf")
    static = case.startswith("static")
    codec = Codec.default()
    where: dict[str, tuple[str, int]] = {}  # request id → (dispatch topic, partition)
    served: list[tuple[str, int, int]] = []  # (worker id, started_at ms, partition index)
    lock = threading.Lock()
    topic = s.topics.dispatch_topic(Priority.NORMAL)
    parts = s.topics.dispatch_partitions
    counter = iter(range(10**9))

    def route(req: Request) -> None:
        req.admitted_at = int(time.time() * 1000)  # as the gateway stamps what it admits
        req.effective_priority = req.priority

    def topic_for(req: Request) -> str:
        return topic

    def on_response(msg, resp) -> None:
        with lock:
            p = where.get(resp.request_id)
            if p is not None and resp.started_at:
                served.append((resp.worker_id, resp.started_at, p))

    class Load(PacedLoad):
        def run(self) -> None:  # explicit partitions: every partition gets its share of the load
            codec_ = Codec.default()
            producer = Producer(self.settings.kafka.producer_config(**{"linger.ms": 2}))
            t0 = time.monotonic()
            try:
                while not self._stop_event.is_set():
                    i = next(counter)
                    delay = t0 + i / self.rate - time.monotonic()
                    if delay > 0:
                        self._stop_event.wait(delay)
                    req = Request.new(f"tenant-{i % 24}", f"w{i}", max_tokens=4, timeout_ms=600_000)
                    route(req)
                    with lock:
                        where[req.request_id] = i % parts
                    producer.produce(topic, codec_.encode_request(req), req.tenant_id.encode(), partition=i % parts)
                    producer.poll(0)
                producer.flush(30)
            except BaseException as exc:  # noqa: BLE001
                self.error = exc

    env = {"LLMQ_WORKER__SESSION_TIMEOUT_MS": str(session_ms)}
    if static:
        env["LLMQ_WORKER__STATIC_MEMBERSHIP"] = "true"
    with tempfile.TemporaryDirectory(prefix="llmq-wfailover-") as tmp:
        workers = [WorkerProcess(f"w{i}", s, Path(tmp), worker_id=f"{case}-w{i}", env=env) for i in range(2)]
        watch = TopicWatch(s, [s.topics.responses], codec.decode_response, on_response)
        load = Load(s, [], rate, topic_for=topic_for)
        try:
            for w in workers:
                w.start()
            watch.start()
            load.start()
            # Both serving: each partition answered recently, by one of the two.
            deadline = time.monotonic() + 60
            while True:
                time.sleep(1)
                with lock:
                    recent = {p: wid for wid, at, p in served if at > time.time() * 1000 - 2000}
                if len(recent) == parts and len(set(recent.values())) == 2:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{case}: the two workers did not share the partitions within 60 s: {recent}")
            victim, other = workers
            held = sorted(p for p, wid in recent.items() if wid == victim.worker_id)
            if case.endswith("kill") or case == "static_kill_restart":
                at = victim.kill()
            else:
                at = time.time()
                victim.proc.send_signal(signal.SIGTERM)
                victim.proc.wait(60)
            if case == "static_kill_restart":
                victim.start()
            at_ms = at * 1000
            first: dict[int, float] = {}
            deadline = time.monotonic() + max(60.0, 3 * session_ms / 1000)
            while len(first) < len(held) and time.monotonic() < deadline:
                time.sleep(0.1)
                with lock:
                    for wid, started, p in served:
                        if p in held and started > at_ms and p not in first:
                            first[p] = (started - at_ms) / 1000.0
            if len(first) < len(held):
                raise RuntimeError(f"{case}: partitions {sorted(set(held) - set(first))} not consumed again")
            by = {wid for wid, started, p in served if p in held and started > at_ms}
        finally:
            load.stop()
            watch.stop()
            for w in workers:
                w.terminate()
            _keep_logs(args, Path(tmp), case)
    res = {"first_s": round(min(first.values()), 3), "all_s": round(max(first.values()), 3),
           "partitions_moved": len(held), "consumed_again_by": sorted(by)}
    _log(f"  worker {case}: {len(held)} partitions consumed again after {res['first_s']:.2f} s (first), "
         f"{res['all_s']:.2f} s (all), by {res['consumed_again_by']}")
    return res


# -- standalone -------------------------------------------------------------------------------


class _Broker(LocalBroker):
    """The local broker with a few server properties of this script's choosing (measurements only)."""

    extra: dict[str, str] = {}

    def write_config(self, controller_port: int) -> None:
        super().write_config(controller_port)
        with open(self.properties, "a") as f:
            f.writelines(f"{k}={v}\n" for k, v in self.extra.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="*", choices=[[], "gateway", "worker"], default=[])
    parser.add_argument("--gateways", type=int, default=3)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--static", action="store_true", help="gateways with instance ids (static members)")
    parser.add_argument("--session-timeout-ms", type=int, help="gateway.session_timeout_ms (default: llmq's)")
    parser.add_argument("--worker-session-timeout-ms", type=int, default=6000)
    parser.add_argument("--rate", type=float, default=60.0, help="steady load, requests/s")
    parser.add_argument("--faust-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a Faust setting by its environment variable (e.g. TABLE_STANDBY_REPLICAS=0)")
    parser.add_argument("--broker-min-session-ms", type=int,
                        help="this script's own broker: group.min.session.timeout.ms (llmq broker's 1000; Kafka's 6000)")
    parser.add_argument("--keep-logs", type=Path, help="copy the processes' logs here")
    parser.add_argument("--out", type=Path, help="also write the result (JSON) here")
    args = parser.parse_args(argv)
    args.gateway_env = dict(kv.split("=", 1) for kv in args.faust_env)
    what = args.what or ["gateway", "worker"]
    bootstrap = os.environ.get("LLMQ_BENCH_BOOTSTRAP")
    broker = None
    tmp = tempfile.TemporaryDirectory(prefix="llmq-failover-broker-")
    if not bootstrap:
        broker = _Broker(free_port(), Path(tmp.name) / "kafka", heap="768m", progress=_log)
        if args.broker_min_session_ms:
            broker.extra = {"group.min.session.timeout.ms": str(args.broker_min_session_ms)}
        broker.up()
        bootstrap = broker.bootstrap
    results = {}
    try:
        settings = Settings.load(env={})
        settings.kafka.bootstrap = bootstrap
        if "gateway" in what:
            results["gateway_failover"] = gateway_failover(settings, args)
        if "worker" in what:
            results["worker_failover"] = worker_failover(settings, args)
    finally:
        if broker is not None:
            broker.down()
        tmp.cleanup()
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
