"""`make chaos`: the fault harness. Faults as production has them, on a replicated cluster, and
nothing lost.

After Kafka's own replication and transactions system tests (and Jepsen's Kafka analysis): a
three-node KRaft cluster (`llmq broker up --nodes 3`: topics with replication factor 3 and
min.insync.replicas 2), two gateways, a pool of workers and an `llmq serve`, all as processes.
Requests flow all along, through any Kafka client (a paced producer), the SDK and `llmq serve`,
while the harness injects, at random points and one at a time (bench/chaos_faults.py):

  * SIGKILL of the node leading the request, the dispatch and the response partition (restarted
    after a while, as an operator or Kubernetes would);
  * SIGSTOP of a node for longer than its session with the controller, then SIGCONT;
  * a whole-cluster restart;
  * SIGKILL of a worker, and SIGSTOP of a worker for longer than its session (a zombie);
  * model calls slower than max.poll.interval.ms.

Gateways and workers that exit by themselves are restarted and counted. Then the response topic
is read with isolation.level=read_committed and every answer counted per request id. Every
request is valid and the model works, so a request the producer wrote counts as delivered only
when it is answered COMPLETED; an id also answered anything else is wrongly answered. SDK and
serve callers must never wait past their deadline: they get an answer, or (serve) 503 with
Retry-After, which they follow. Each delivery mode runs on its own topics and groups; in
exactly-once mode the gateways and the workers both run exactly-once.

    python bench/chaos.py                                  # both modes
    python bench/chaos.py --modes exactly-once --seed 7 --requests 4000
    python bench/chaos.py --soak 30                        # 30 minutes a mode, a fault every minute

A soak (``--soak MINUTES``) writes at ``--rate`` for that long in each mode, with one fault a
minute (the kinds in turn, each once per round in a random order), then waits for the answers.
The logs of a mode that fails are kept (in LLMQ_CHAOS_KEEP_LOGS if set, which keeps every
mode's; else in a directory named on the way out).

Writes bench/chaos.json. Exit status 1 when, in any mode, a request was not COMPLETED or wrongly
answered, a caller waited past its deadline, an answer was duplicated in exactly-once mode, or a
planned fault was not injected.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402

from chaos_faults import (CLUSTER_FAULTS, MAX_SOAK_MINUTES, WORKER_FAULTS, Faults, Supervised,  # noqa: E402
                          fault_plan, soak_plan)
from chaos_load import Pacer, ResponseCounter, SdkCallers, ServeCallers, fresh_counter, locate  # noqa: E402
from pipeline.broker import free_port, lasting_ports  # noqa: E402
from pipeline.cluster import LocalCluster  # noqa: E402
from pipeline.config import Settings  # noqa: E402
from pipeline.config.gateway import GatewaySettings  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.tenants.keys import hash_key  # noqa: E402
from pipeline.topics import create_pipeline_topics  # noqa: E402

OUT = ROOT / "bench" / "chaos.json"
SESSION_TIMEOUT_MS = 6_000
MAX_POLL_INTERVAL_MS = 10_000
SERVE_KEY = "chaos-serve-key-0123456789abcdef"


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def gateway_guarantee(mode: str) -> str:
    """The gateway's processing guarantee for a run in ``mode``: exactly-once when this version
    of the gateway has it (checked through its settings), at-least-once otherwise."""
    try:
        GatewaySettings(processing_guarantee=mode).validate()
        return mode
    except ConfigError:
        return "at-least-once"


# -- the processes ----------------------------------------------------------------------------


class Pipeline:
    """Two gateways, ``workers`` workers and one serve, as processes on the cluster."""

    def __init__(self, settings: Settings, mode: str, args, log_dir: Path, registry: Path):
        self.settings, self.mode, self.log_dir = settings, mode, log_dir
        self.gateway_mode = gateway_guarantee(mode)
        # PYTHONFAULTHANDLER: a process that dies in native code (librdkafka) leaves its threads'
        # Python stacks in its log.
        base = {**os.environ, **settings.topology_env(), "LLMQ_TENANTS__FILE": str(registry),
                "LLMQ_WORKER__SOURCE": "dispatch", "PYTHONFAULTHANDLER": "1"}
        self.serve_port = free_port()
        self.gateways = [self._proc(f"gateway-{i}", ["gateway", "--app-id", f"{settings.topics.prefix}-gateway"],
                                    {**base, "LLMQ_GATEWAY__WEB_PORT": "0",
                                     "LLMQ_GATEWAY__PROCESSING_GUARANTEE": self.gateway_mode})
                         for i in range(2)]
        worker_env = {**base, "LLMQ_WORKER__METRICS_PORT": "0", "LLMQ_WORKER__COMMIT_INTERVAL_MS": "200",
                      "LLMQ_WORKER__SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS),
                      "LLMQ_WORKER__MAX_POLL_INTERVAL_MS": str(MAX_POLL_INTERVAL_MS),
                      "LLMQ_WORKER__SHUTDOWN_GRACE_S": "20"}
        self.workers = [self._proc(f"{mode}-w{i}", ["worker", "--delivery", mode, "--worker-id", f"chaos-{mode}-w{i}",
                                                    "--sim-latency-ms", str(args.sim_latency_ms),
                                                    "--max-inflight", str(args.max_inflight)], worker_env)
                        for i in range(args.workers)]
        self.serve = self._proc("serve", ["serve", "--port", str(self.serve_port), "--reply-partitions", "0"], base)

    def _proc(self, name: str, argv: list[str], env: dict) -> Supervised:
        home = self.log_dir / f"{self.mode}-{name}"
        home.mkdir(parents=True, exist_ok=True)
        return Supervised(name, [sys.executable, "-m", "pipeline.cli", "--log-level", "INFO", *argv], env,
                          home / "process.log")

    @property
    def all(self) -> list[Supervised]:
        return [*self.gateways, *self.workers, self.serve]

    @property
    def serve_url(self) -> str:
        return f"http://127.0.0.1:{self.serve_port}"

    def start(self, timeout: float = 120.0) -> None:
        for proc in self.all:
            proc.start()
        deadline = time.monotonic() + timeout
        for g in self.gateways:
            while "Worker]: Ready" not in g.log_path.read_text(errors="replace"):
                if g.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{g.name} did not start; see {g.log_path}")
                time.sleep(0.3)
        while True:
            try:
                if httpx.get(f"{self.serve_url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.serve.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"serve did not start; see {self.serve.log_path}")
            time.sleep(0.3)

    def check(self) -> None:
        for proc in self.all:
            proc.check(_log)

    def stop(self) -> dict:
        return {p.name: p.stop() for p in self.all}


def registry_file(path: Path) -> Path:
    path.write_text(f'[chaos-serve]\nkey_hashes = ["{hash_key(SERVE_KEY)}"]\n')
    return path


# -- one mode ---------------------------------------------------------------------------------


def run_mode(mode: str, cluster: LocalCluster, args, rng: random.Random, log_dir: Path) -> dict:
    settings = Settings.load(env={})
    settings.kafka.bootstrap = cluster.bootstrap
    settings.topics.prefix = f"chaos{uuid.uuid4().hex[:6]}.llm"
    settings.topics.request_partitions = args.partitions
    settings.topics.response_partitions = args.partitions
    settings.topics.replication_factor = cluster.replication_factor
    settings.worker.group_id = f"{settings.topics.prefix}.workers"
    create_pipeline_topics(settings)
    pipeline = Pipeline(settings, mode, args, log_dir, registry_file(log_dir / f"{mode}-tenants.toml"))
    _log(f"[{mode}] {settings.topics.prefix}.*: RF {cluster.replication_factor}; gateways {pipeline.gateway_mode}, "
         f"workers {mode}; starting 2 gateways, {args.workers} workers, serve")
    pipeline.start()
    n = args.requests
    kinds = CLUSTER_FAULTS + WORKER_FAULTS
    plan = soak_plan(rng, args.soak, kinds) if args.soak else fault_plan(rng, kinds)
    _log(f"[{mode}] {n:,} requests at {args.rate:g}/s through a plain producer, plus SDK and serve callers; "
         f"fault plan: " + (f"{len(plan)} faults, one a minute" if args.soak else
                            ", ".join(f"{k} at {p:.0%}" for p, k in plan)))
    faults = Faults(cluster, settings, pipeline.workers, rng, lambda m: _log(f"[{mode}] {m}"),
                    down_s=args.leader_down_s, freeze_s=args.freeze_s, worker_stop_s=SESSION_TIMEOUT_MS / 1000 + 4)
    counter = ResponseCounter(settings)
    counter.start()
    pacer = Pacer(settings, n, args.rate, args.slow_calls, MAX_POLL_INTERVAL_MS + 5_000)
    sdk = SdkCallers(settings, threads=2)
    serve = ServeCallers(pipeline.serve_url, SERVE_KEY, threads=2)
    pacer.start()
    sdk.start()
    serve.start()
    events = []
    t0 = time.monotonic()
    deadline = t0 + args.timeout
    pending = list(plan)
    last_report = t0
    callers_stopped = False
    try:
        while True:
            pipeline.check()
            written = len(pacer.ids)
            if pending and written >= pending[0][0] * n:
                _, kind = pending.pop(0)
                at = round(time.monotonic() - t0, 1)
                event = faults.inject(kind)
                events.append({"t_s": at, "written": written, "answered": len(counter.counts), **event})
                if kind == "cluster-restart":
                    # An assign()ed librdkafka consumer can stop fetching after a broker restart
                    # (librdkafka#5153): read on with a fresh one.
                    time.sleep(2)
                    counter = fresh_counter(settings, counter)
                continue
            if not pacer.is_alive() and not callers_stopped:
                sdk.stop()
                serve.stop()
                callers_stopped = True
            expected = set(pacer.ids) - set(pacer.undelivered)
            if callers_stopped and not pending and all(rid in counter.counts for rid in expected):
                break
            if time.monotonic() > deadline:
                _log(f"[{mode}] gave up after {args.timeout:.0f} s")
                break
            if time.monotonic() - counter.last_progress > args.stall_s:
                # Nothing new for a while: a stuck reader (librdkafka#5153) or nothing readable?
                counter = fresh_counter(settings, counter)
                time.sleep(3)
                events.append({"t_s": round(time.monotonic() - t0, 1), "stall": True,
                               "fresh_reader_saw_after_3_s": len(counter.counts)})
                continue
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                dup = sum(c - 1 for c in list(counter.counts.values()))
                _log(f"[{mode}] written {written:,}/{n:,}, answered {len(counter.counts):,}, {dup} duplicates so far; "
                     f"sdk {len(sdk.log.completed)}, serve {len(serve.log.completed)} completed; "
                     f"{len(pending)} faults to go")
            time.sleep(0.2)
        for _, kind in pending:
            _log(f"[{mode}] FAILED: {kind} was planned but the run finished first")
    finally:
        if not callers_stopped:
            sdk.stop()
            serve.stop()
        exit_codes = pipeline.stop()
    time.sleep(3)  # a zombie's late publish gets a moment to show up before the count
    counter.stop()
    final = ResponseCounter(settings)
    final.start()
    final.settle()
    final.stop()
    result = summarize(mode, pipeline, pacer, sdk, serve, final, events, [k for _, k in pending], exit_codes,
                       time.monotonic() - t0, args)
    if result["unanswered"]:
        # While the cluster still runs: hidden behind a transaction, stuck before a worker, or lost?
        written = set(pacer.ids) - set(pacer.undelivered)
        result.update(locate(settings, {rid for rid in written if final.counts[rid] == 0}))
        _log(f"[{mode}] unanswered: {result['unanswered_where']}; response partitions behind open transactions: "
             f"{result['responses_behind_open_transactions'] or 'none'}")
    return result


def summarize(mode, pipeline, pacer, sdk, serve, final, events, not_injected, exit_codes, elapsed, args) -> dict:
    counts, by_id = final.counts, final.by_id
    written = [rid for rid in pacer.ids if rid not in set(pacer.undelivered)]
    unanswered = sum(1 for rid in written if counts[rid] == 0)
    wrong = collections.Counter(st for rid in written for st in by_id.get(rid, ()) if st != "COMPLETED")
    wrongly = sum(1 for rid in written if by_id.get(rid, set()) - {"COMPLETED"})
    lost = sum(1 for rid in written if "COMPLETED" not in by_id.get(rid, ()))
    known = [*written, *sdk.submitted, *[r for r in serve.log.completed if r]]
    two_statuses = sum(1 for rid in known if len(by_id.get(rid, ())) > 1)
    duplicates = sum(counts[rid] - 1 for rid in known if counts[rid] > 1)
    result = {
        "requests": len(pacer.ids), "not_acknowledged_to_the_writer": len(pacer.undelivered), "lost": lost,
        "unanswered": unanswered, "wrongly_answered": wrongly, "wrong_statuses": dict(wrong),
        "ids_with_two_statuses": two_statuses, "duplicates": duplicates,
        "ids_answered_more_than_once": sum(1 for rid in known if counts[rid] > 1),
        "statuses": dict(final.statuses), "sdk": sdk.log.summary(), "serve": serve.log.summary(),
        "gateway_guarantee": pipeline.gateway_mode, "elapsed_s": round(elapsed, 1), "faults": events,
        "faults_not_injected": not_injected,
        "unexpected_exits": {p.name: p.unexpected_exits for p in pipeline.all if p.unexpected_exits},
        "exit_codes": exit_codes, "workers": args.workers, "partitions": args.partitions, "rate": args.rate,
        "sim_latency_ms": args.sim_latency_ms, "max_inflight": args.max_inflight, "slow_calls": args.slow_calls,
        "session_timeout_ms": SESSION_TIMEOUT_MS, "max_poll_interval_ms": MAX_POLL_INTERVAL_MS,
        "leader_down_s": args.leader_down_s, "freeze_s": args.freeze_s}
    _log(f"[{mode}] {len(written):,} requests: not COMPLETED {lost} ({unanswered} unanswered, {wrongly} answered "
         f"{dict(wrong) or 'nothing else'}), duplicates {duplicates}; sdk {result['sdk']}; serve {result['serve']}")
    return result


def failed(mode: str, r: dict) -> list[str]:
    """Why a mode's run fails (nothing: it passed). A run that could flatter fails."""
    why = []
    if r["lost"] or r["wrongly_answered"] or r["ids_with_two_statuses"]:
        why.append("requests lost or wrongly answered")
    if r["faults_not_injected"]:
        why.append(f"faults not injected: {r['faults_not_injected']}")
    if mode == "exactly-once" and r["duplicates"]:
        why.append(f"{r['duplicates']} duplicates in exactly-once mode")
    for kind in ("sdk", "serve"):
        if r[kind]["past_deadline"]:
            why.append(f"{r[kind]['past_deadline']} {kind} calls waited past their deadline")
    # A 503 (Kafka could not take the request; Retry-After) and a 504 at the deadline are answers
    # a caller can act on; giving up on retrying at its own deadline too.
    bad = {k: v for k, v in r["serve"]["other"].items() if k not in ("503", "504") and not k.startswith("gave up")}
    if bad:
        why.append(f"serve answered {bad}")
    return why


def keep_logs(log_dir: Path, mode: str, seed: int) -> Path:
    """Copy the logs of ``mode``'s processes out of the run's temporary directory (which goes at
    the end): to LLMQ_CHAOS_KEEP_LOGS if set, else to a directory of the seed's. Returns it."""
    import shutil

    dest = Path(os.environ.get("LLMQ_CHAOS_KEEP_LOGS") or Path(tempfile.gettempdir()) / f"llmq-chaos-failed-{seed}")
    for path in log_dir.glob(f"{mode}-*"):
        if path.is_dir():
            shutil.copytree(path, dest / path.name, dirs_exist_ok=True)
        else:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / path.name)
    return dest


def soak_minutes(value: str) -> int:
    """``--soak``'s argument: whole minutes, within the bound."""
    minutes = int(value)
    if not 1 <= minutes <= MAX_SOAK_MINUTES:
        raise argparse.ArgumentTypeError(f"a soak runs 1-{MAX_SOAK_MINUTES} minutes")
    return minutes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8_000, help="requests per mode from the producer (default 8,000)")
    parser.add_argument("--rate", type=float, default=40.0, help="the producer's requests a second (default 40)")
    parser.add_argument("--modes", default="at-least-once,exactly-once", help="comma-separated delivery modes")
    parser.add_argument("--nodes", type=int, default=3, help="cluster nodes (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes in the pool (default 2)")
    parser.add_argument("--partitions", type=int, default=6, help="partitions per request/response topic")
    parser.add_argument("--sim-latency-ms", type=float, default=60.0, help="model latency per request (default 60)")
    parser.add_argument("--max-inflight", type=int, default=8, help="requests in flight per worker (default 8)")
    parser.add_argument("--slow-calls", type=int, default=3,
                        help="requests whose model call outlasts max.poll.interval.ms (default 3)")
    parser.add_argument("--leader-down-s", type=float, default=15.0,
                        help="how long a killed leader stays down (default 15)")
    parser.add_argument("--freeze-s", type=float, default=14.0,
                        help="how long a node is SIGSTOPped (default 14: past the brokers' 9-s session)")
    parser.add_argument("--stall-s", type=float, default=15.0,
                        help="no new response this long: check with a fresh reader (default 15)")
    parser.add_argument("--seed", type=int, help="fault schedule seed (default: random, printed)")
    parser.add_argument("--timeout", type=float,
                        help="give up on a mode after this many seconds (default 900; a soak: its minutes plus 900 s)")
    parser.add_argument("--soak", type=soak_minutes, metavar="MINUTES",
                        help="soak each mode for MINUTES (1-%d): requests at --rate for that long (in place of "
                             "--requests) with one fault a minute, every kind in turn; stops by itself once the "
                             "answers are in or --timeout passes" % MAX_SOAK_MINUTES)
    args = parser.parse_args(argv)
    if args.soak:
        args.requests = max(1, round(args.rate * args.soak * 60))
    if args.timeout is None:
        args.timeout = 900.0 + (args.soak or 0) * 60.0
    # The harness's own SDK client would log every connection a fault breaks; the processes'
    # logs keep theirs.
    logging.getLogger("pipeline").setLevel(logging.ERROR)
    # SIGTERM (a CI time limit, `timeout`): unwind, so that the processes and the cluster stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    _log(f"seed {seed} (rerun the same fault schedule with --seed {seed})")
    rng = random.Random(seed)

    base = Settings.load(env={})
    tmp = tempfile.TemporaryDirectory(prefix="llmq-chaos-")
    log_dir = Path(tmp.name) / "logs"
    log_dir.mkdir()
    port = lasting_ports(args.nodes)
    cluster = LocalCluster(args.nodes, port, Path(tmp.name) / "kafka", kafka_version=base.broker.kafka_version,
                           heap="512m", progress=_log)
    _log(f"starting a {args.nodes}-node chaos cluster at {cluster.bootstrap} (data in {cluster.data_dir})")
    cluster.up()
    results = {}
    kept = {}
    try:
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            results[mode] = run_mode(mode, cluster, args, rng, log_dir)
            if failed(mode, results[mode]):
                kept[mode] = keep_logs(log_dir, mode, seed)
                _log(f"[{mode}] failed: its processes' logs kept in {kept[mode]}")
    finally:
        cluster.down()
        keep = os.environ.get("LLMQ_CHAOS_KEEP_LOGS")
        if keep:
            import shutil

            shutil.copytree(log_dir, keep, dirs_exist_ok=True)
            _log(f"process logs copied to {keep}")
        tmp.cleanup()

    existing = json.loads(OUT.read_text()) if OUT.exists() else {}
    existing["modes"] = {**existing.get("modes", {}), **results}
    existing["conditions"] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(), "seed": seed,
                              "kafka": base.broker.kafka_version, "nodes": args.nodes,
                              "replication_factor": args.nodes, "min_insync_replicas": min(2, args.nodes - 1),
                              "soak_minutes": args.soak}
    OUT.write_text(json.dumps(existing, indent=2) + "\n")

    print(f"\n{'mode':<15} {'requests':>9} {'lost':>6} {'wrong':>6} {'duplicates':>11} {'faults':>7} "
          f"{'sdk ok':>7} {'serve ok':>9} {'serve 503s':>11} {'seconds':>8}")
    bad = False
    for mode, r in results.items():
        print(f"{mode:<15} {r['requests']:>9,} {r['lost']:>6} {r['wrongly_answered']:>6} {r['duplicates']:>11} "
              f"{len(r['faults']):>7} {r['sdk']['completed']:>7} {r['serve']['completed']:>9} "
              f"{r['serve']['retried_after_503']:>11} {r['elapsed_s']:>8}  statuses {r['statuses']}")
        why = failed(mode, r)
        for w in why:
            print(f"  FAILED ({mode}): {w}")
        if mode in kept:
            print(f"  logs of {mode}'s processes: {kept[mode]}")
        bad |= bool(why)
    print(f"\n(written to {OUT.relative_to(ROOT)}; seed {seed})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
