"""`make chaos`: the fault harness. Nothing lost under kills, a broker restart and a frozen worker.

After Kafka's own transactions system test: fill the request topics with N requests, let a pool
of worker processes answer them through a real local broker, and meanwhile inject

  * SIGKILL of a worker, three times, at random points (the supervisor — this script — restarts it
    with the same worker id, as systemd or Kubernetes would);
  * one broker restart (`llmq broker down`, then `up` on the same data dir);
  * one SIGSTOP of a worker for longer than the session timeout, then SIGCONT (a zombie: the group
    moves its partitions while it sleeps, and its late work must not count twice in exactly-once);
  * model calls slower than max.poll.interval.ms (the simulated model honours a per-request
    latency in the request's metadata).

Then read the response topic with isolation.level=read_committed and count, per request id, its
answers and their statuses. Every request is valid and the model works, so a request counts as
delivered only when it is answered COMPLETED; an id also answered anything else is wrongly
answered. Each delivery mode runs on its own topics and group.

    python bench/chaos.py                                  # both modes, N = 20,000
    python bench/chaos.py --requests 2000 --modes exactly-once --seed 7

Writes bench/chaos.json: {"modes": {"at-least-once": {"requests", "lost", "duplicates", ...}, ...}}.
Exit status 1 when a request was not COMPLETED or wrongly answered in any mode, duplicated in
exactly-once mode, or a planned fault was not injected.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition  # noqa: E402

from pipeline.broker import LocalBroker, free_port  # noqa: E402
from pipeline.config import Settings  # noqa: E402
from pipeline.models import Priority, Request  # noqa: E402
from pipeline.serde import Codec  # noqa: E402
from pipeline.topics import create_pipeline_topics  # noqa: E402
from pipeline.testing import produce_request  # noqa: E402
from pipeline.worker.backends.simulated import LATENCY_METADATA_KEY  # noqa: E402

OUT = ROOT / "bench" / "chaos.json"
SESSION_TIMEOUT_MS = 6_000
MAX_POLL_INTERVAL_MS = 10_000


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


# -- the load ---------------------------------------------------------------------------------


def fill(settings: Settings, n: int, slow_calls: int) -> list[str]:
    """Produce ``n`` requests over every band and 20 tenants; the first ``slow_calls`` outlast
    max.poll.interval.ms in the model. Returns their ids."""
    codec = Codec.default()
    producer = Producer(settings.kafka.producer_config(**{"linger.ms": 20}))
    ids = []
    slow_ms = str(MAX_POLL_INTERVAL_MS + 5_000)
    for i in range(n):
        metadata = {LATENCY_METADATA_KEY: slow_ms} if i < slow_calls else {}
        req = Request.new(f"tenant-{i % 20}", f"chaos request {i}", priority=list(Priority)[i % 5],
                          max_tokens=8, timeout_ms=3_600_000, metadata=metadata)
        ids.append(req.request_id)
        produce_request(producer, settings, codec, req)
    if producer.flush(60) != 0:
        raise SystemExit("could not write the requests to the broker")
    return ids


def _fresh_counter(settings: Settings, old: "ResponseCounter") -> "ResponseCounter":
    """A new reader from the start of the response topic in place of ``old``."""
    fresh = ResponseCounter(settings)
    fresh.start()
    old.stop()
    return fresh


class ResponseCounter(threading.Thread):
    """Counts responses per request id as a read_committed consumer sees them, while faults happen."""

    def __init__(self, settings: Settings):
        super().__init__(name="response-counter", daemon=True)
        self.settings = settings
        self.counts: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[str] = collections.Counter()
        #: every status each request id was answered with
        self.by_id: collections.defaultdict[str, set[str]] = collections.defaultdict(set)
        self._stop_event = threading.Event()
        self.last_progress = time.monotonic()

    def run(self) -> None:
        codec = Codec.default()
        consumer = Consumer({"bootstrap.servers": self.settings.kafka.bootstrap,
                             "group.id": f"chaos-reader-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
                             "isolation.level": "read_committed", "auto.offset.reset": "earliest"})
        topic = self.settings.topics.responses
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        try:
            while not self._stop_event.is_set():
                for msg in consumer.consume(1000, 0.2):
                    if msg.error() is not None:
                        continue
                    resp = codec.decode_response(msg.value())
                    self.counts[resp.request_id] += 1
                    self.statuses[resp.status.value] += 1
                    self.by_id[resp.request_id].add(resp.status.value)
                    self.last_progress = time.monotonic()
        finally:
            consumer.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)

    def settle(self, quiet_s: float = 2.0) -> "ResponseCounter":
        """Wait until this (fresh) reader has read what there is to read."""
        time.sleep(1)
        while True:
            before = sum(self.counts.values())
            time.sleep(quiet_s)
            if sum(self.counts.values()) == before:
                return self


# -- the workers, supervised ------------------------------------------------------------------


@dataclass
class WorkerProcess:
    worker_id: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    unexpected_exits: list[int] = field(default_factory=list)
    stopped: bool = False

    def start(self) -> None:
        log = open(self.log_path, "a")
        log.write(f"--- start {time.strftime('%H:%M:%S')}\n")
        log.flush()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def check(self) -> None:
        """A supervisor restarts a worker that exited by itself; the harness counts it."""
        if self.proc.poll() is not None and not self.stopped:
            self.unexpected_exits.append(self.proc.returncode)
            _log(f"  {self.worker_id} exited by itself (rc {self.proc.returncode}); restarting it")
            self.start()


def start_workers(settings: Settings, mode: str, count: int, args, log_dir: Path) -> list[WorkerProcess]:
    env = {**os.environ,
           "LLMQ_BOOTSTRAP": settings.kafka.bootstrap,
           "LLMQ_TOPICS__PREFIX": settings.topics.prefix,
           "LLMQ_WORKER__GROUP_ID": settings.worker.group_id,
           "LLMQ_WORKER__METRICS_PORT": "0",
           "LLMQ_WORKER__COMMIT_INTERVAL_MS": "200",
           "LLMQ_WORKER__SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS),
           "LLMQ_WORKER__MAX_POLL_INTERVAL_MS": str(MAX_POLL_INTERVAL_MS),
           "LLMQ_WORKER__SHUTDOWN_GRACE_S": "20"}
    workers = []
    for i in range(count):
        wid = f"chaos-{mode}-w{i}"
        argv = [sys.executable, "-m", "pipeline.cli", "--log-level", "INFO", "worker", "--delivery", mode,
                "--worker-id", wid, "--sim-latency-ms", str(args.sim_latency_ms),
                "--max-inflight", str(args.max_inflight)]
        w = WorkerProcess(wid, argv, env, log_dir / f"{wid}.log")
        w.start()
        workers.append(w)
    return workers


# -- one mode ---------------------------------------------------------------------------------


def fault_plan(rng: random.Random) -> list[tuple[float, str]]:
    """Five faults at random points of the run (fractions of requests answered), spaced apart so
    each one's recovery overlaps the next one's, not the same instant."""
    kinds = ["kill", "kill", "kill", "broker-restart", "stop"]
    rng.shuffle(kinds)
    points = sorted(rng.uniform(0.05, 0.85) for _ in kinds)
    for i in range(1, len(points)):
        points[i] = max(points[i], points[i - 1] + 0.06)
    return list(zip(points, kinds))


def run_mode(mode: str, broker: LocalBroker, args, rng: random.Random, log_dir: Path) -> dict:
    settings = Settings.load(env={})
    settings.kafka.bootstrap = broker.bootstrap
    settings.topics.prefix = f"chaos{uuid.uuid4().hex[:6]}.llm"
    settings.topics.request_partitions = args.partitions
    settings.topics.response_partitions = args.partitions
    settings.worker.group_id = f"{settings.topics.prefix}.workers"
    create_pipeline_topics(settings)
    n = args.requests
    _log(f"[{mode}] filling {n:,} requests into {settings.topics.prefix}.* ({args.slow_calls} slower than "
         f"max.poll.interval.ms = {MAX_POLL_INTERVAL_MS} ms)")
    ids = fill(settings, n, args.slow_calls)
    plan = fault_plan(rng)
    _log(f"[{mode}] fault plan: " + ", ".join(f"{k} at {p:.0%}" for p, k in plan))

    counter = ResponseCounter(settings)
    counter.start()
    workers = start_workers(settings, mode, args.workers, args, log_dir)
    events = []
    t0 = time.monotonic()
    last_report = t0
    deadline = t0 + args.timeout
    pending = list(plan)
    last_fault = 0.0
    try:
        while True:
            answered = len(counter.counts)
            if answered >= n:
                break
            if time.monotonic() > deadline:
                _log(f"[{mode}] gave up after {args.timeout:.0f} s with {answered:,}/{n:,} answered")
                break
            for w in workers:
                w.check()
            # One fault at a time, each given time to bite before the next one.
            if pending and answered >= pending[0][0] * n and time.monotonic() - last_fault >= args.fault_gap_s:
                _, kind = pending.pop(0)
                victim = rng.choice(workers)
                at = round(time.monotonic() - t0, 1)
                if kind == "kill":
                    _log(f"[{mode}] SIGKILL {victim.worker_id} at {answered:,} answered")
                    victim.stopped = True
                    victim.signal(signal.SIGKILL)
                    victim.proc.wait(10)
                    victim.stopped = False
                    victim.start()
                    events.append({"t_s": at, "answered": answered, "fault": "SIGKILL", "worker": victim.worker_id})
                elif kind == "broker-restart":
                    _log(f"[{mode}] broker down at {answered:,} answered")
                    broker.down()
                    time.sleep(3)
                    broker.up()
                    _log(f"[{mode}] broker up again after {time.monotonic() - t0 - at:.1f} s")
                    events.append({"t_s": at, "answered": answered, "fault": "broker restart",
                                   "down_s": round(time.monotonic() - t0 - at, 1)})
                    # An assign()ed librdkafka consumer can stop fetching after a broker restart
                    # (librdkafka#5153): read on with a fresh one (started once the broker has
                    # settled a little) rather than wait for the stall check, or the faults
                    # planned late in the run come after its end.
                    time.sleep(2)
                    counter = _fresh_counter(settings, counter)
                else:
                    pause = SESSION_TIMEOUT_MS / 1000 + 4
                    _log(f"[{mode}] SIGSTOP {victim.worker_id} for {pause:.0f} s at {answered:,} answered")
                    victim.signal(signal.SIGSTOP)
                    time.sleep(pause)
                    victim.signal(signal.SIGCONT)
                    events.append({"t_s": at, "answered": answered, "fault": "SIGSTOP", "worker": victim.worker_id,
                                   "stopped_s": pause})
                last_fault = time.monotonic()
            if time.monotonic() - counter.last_progress > args.stall_s:
                # Nothing new for a while: is the reader stuck (an assign()ed librdkafka consumer
                # can stop fetching after a broker restart, librdkafka#5153), or is nothing
                # readable (an open transaction holding the last stable offset)? A fresh reader
                # tells them apart, and carries on in its place.
                # Not settled: while the workers answer, a reader never goes quiet, and waiting
                # for that let the run end before the faults planned after the stall.
                counter = _fresh_counter(settings, counter)
                time.sleep(3)
                _log(f"[{mode}] no new response for {args.stall_s:.0f} s at {answered:,} answered; a fresh "
                     f"read_committed reader sees {len(counter.counts):,} after 3 s")
                events.append({"t_s": round(time.monotonic() - t0, 1), "stall": True, "reader_saw": answered,
                               "fresh_reader_saw_after_3_s": len(counter.counts)})
                continue
            if time.monotonic() - last_report > 5:
                last_report = time.monotonic()
                dup = sum(c - 1 for c in list(counter.counts.values()))
                _log(f"[{mode}] {answered:,}/{n:,} answered, {dup} duplicates so far, "
                     f"{len(pending)} faults to go")
            time.sleep(0.1)
        for _, kind in pending:
            _log(f"[{mode}] FAILED: {kind} was planned but the run finished first (lower --sim-latency-ms?)")
    finally:
        for w in workers:
            w.stopped = True
            if w.proc.poll() is None:
                w.signal(signal.SIGCONT)
                w.signal(signal.SIGTERM)
        exit_codes = {}
        for w in workers:
            try:
                exit_codes[w.worker_id] = w.proc.wait(60)
            except subprocess.TimeoutExpired:
                w.signal(signal.SIGKILL)
                exit_codes[w.worker_id] = "killed after 60 s"
    # Straggling duplicates (a zombie's late publish) get a moment to show up before the count.
    time.sleep(3)
    counter.stop()
    final = ResponseCounter(settings)
    final.start()
    final.settle()
    final.stop()
    elapsed = time.monotonic() - t0
    counts = final.counts
    # Every request is valid and the model works: only COMPLETED is the answer it deserves. An id
    # never answered is lost; one answered anything else (alone or besides COMPLETED) is wrong.
    unanswered = sum(1 for rid in ids if counts[rid] == 0)
    wrong = collections.Counter(status for rid in ids for status in final.by_id.get(rid, ()) if status != "COMPLETED")
    wrongly_answered = sum(1 for rid in ids if final.by_id.get(rid, set()) - {"COMPLETED"})
    two_statuses = sum(1 for rid in ids if len(final.by_id.get(rid, ())) > 1)
    lost = sum(1 for rid in ids if "COMPLETED" not in final.by_id.get(rid, ()))
    duplicates = sum(c - 1 for rid, c in counts.items() if c > 1)
    multi = sum(1 for c in counts.values() if c > 1)
    result = {"requests": n, "lost": lost, "unanswered": unanswered, "wrongly_answered": wrongly_answered,
              "wrong_statuses": dict(wrong), "ids_with_two_statuses": two_statuses, "duplicates": duplicates, "exactly_one": sum(1 for rid in ids if counts[rid] == 1),
              "more_than_one": multi, "statuses": dict(final.statuses), "elapsed_s": round(elapsed, 1),
              "faults": events, "faults_not_injected": [k for _, k in pending], "unexpected_worker_exits": {w.worker_id: w.unexpected_exits for w in workers},
              "worker_exit_codes": exit_codes, "workers": args.workers, "partitions": args.partitions,
              "sim_latency_ms": args.sim_latency_ms, "max_inflight": args.max_inflight,
              "slow_calls": args.slow_calls, "session_timeout_ms": SESSION_TIMEOUT_MS,
              "max_poll_interval_ms": MAX_POLL_INTERVAL_MS}
    _log(f"[{mode}] {n:,} requests: not COMPLETED {lost} ({unanswered} unanswered, {wrongly_answered} answered "
         f"{dict(wrong) or 'nothing else'}), duplicates {duplicates} ({multi} ids answered more than once), "
         f"{elapsed:.0f} s")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000, help="requests per mode (default 20,000)")
    parser.add_argument("--modes", default="at-least-once,exactly-once", help="comma-separated delivery modes")
    parser.add_argument("--workers", type=int, default=2, help="worker processes in the pool (default 2)")
    parser.add_argument("--partitions", type=int, default=6, help="partitions per request/response topic")
    parser.add_argument("--sim-latency-ms", type=float, default=60.0,
                        help="model latency per request; sets how long the run lasts (default 60)")
    parser.add_argument("--max-inflight", type=int, default=8, help="requests in flight per worker (default 8)")
    parser.add_argument("--slow-calls", type=int, default=3,
                        help="requests whose model call outlasts max.poll.interval.ms (default 3)")
    parser.add_argument("--fault-gap-s", type=float, default=8.0, help="least time between two faults (default 8)")
    parser.add_argument("--stall-s", type=float, default=8.0,
                        help="no new response this long: check with a fresh reader (default 8)")
    parser.add_argument("--seed", type=int, help="fault schedule seed (default: random, printed)")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up on a mode after this many seconds")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    _log(f"seed {seed} (rerun the same fault schedule with --seed {seed})")
    rng = random.Random(seed)

    base = Settings.load(env={})
    tmp = tempfile.TemporaryDirectory(prefix="llmq-chaos-")
    log_dir = Path(tmp.name) / "logs"
    log_dir.mkdir()
    broker = LocalBroker(free_port(), Path(tmp.name) / "kafka", kafka_version=base.broker.kafka_version,
                         heap="1g", progress=_log)
    _log(f"starting a chaos broker at {broker.bootstrap} (data in {broker.data_dir})")
    broker.up()
    results = {}
    try:
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            results[mode] = run_mode(mode, broker, args, rng, log_dir)
    finally:
        broker.down()
        keep = os.environ.get("LLMQ_CHAOS_KEEP_LOGS")
        if keep:
            import shutil

            shutil.copytree(log_dir, keep, dirs_exist_ok=True)
            _log(f"worker logs copied to {keep}")
        tmp.cleanup()

    existing = json.loads(OUT.read_text()) if OUT.exists() else {}
    existing.setdefault("modes", {}).update(results)
    existing["conditions"] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(), "seed": seed,
                              "kafka": base.broker.kafka_version}
    OUT.write_text(json.dumps(existing, indent=2) + "\n")

    print(f"\n{'mode':<15} {'requests':>9} {'lost':>6} {'wrong':>6} {'duplicates':>11} {'not injected':>13} "
          f"{'self-exits':>11} {'seconds':>8}")
    failed = False
    for mode, r in results.items():
        exits = sum(len(v) for v in r["unexpected_worker_exits"].values())
        print(f"{mode:<15} {r['requests']:>9,} {r['lost']:>6} {r['wrongly_answered']:>6} {r['duplicates']:>11} "
              f"{len(r['faults_not_injected']):>13} {exits:>11} {r['elapsed_s']:>8}  statuses {r['statuses']}")
        # A run that could flatter fails: a valid request not COMPLETED, or answered anything else too,
        # a duplicate in exactly-once mode, or a planned fault that never happened.
        failed |= (r["lost"] > 0 or r["wrongly_answered"] > 0 or r["faults_not_injected"]
                   or (mode == "exactly-once" and r["duplicates"] > 0))
    print(f"\n(written to {OUT.relative_to(ROOT)}; seed {seed})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
