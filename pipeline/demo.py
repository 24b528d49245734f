"""`llmq demo`: the whole pipeline on the local broker, from an empty machine to a summary table."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict

from pipeline.broker import LocalBroker, broker_answers
from pipeline.client import LlmqClient
from pipeline.config import Settings
from pipeline.models import Priority, Request, Status
from pipeline.progress import Progress
from pipeline.topics import create_pipeline_topics

_MIX = {Priority.CRITICAL: 5, Priority.HIGH: 15, Priority.NORMAL: 40, Priority.LOW: 20, Priority.BACKGROUND: 20}
_FLOOD_MIX = {Priority.CRITICAL: 5, Priority.HIGH: 10, Priority.NORMAL: 15, Priority.LOW: 10, Priority.BACKGROUND: 60}
_TENANTS = [f"tenant-{name}" for name in ("acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne", "tyrell")]
_PROMPTS = ["Summarise this incident report", "Translate to French: the queue is empty",
            "Write a haiku about consumer lag", "Classify this ticket: my invoice is wrong",
            "Explain exactly-once semantics in one paragraph"]


def _say(msg: str) -> None:
    print(f"==> {msg}", file=sys.stderr, flush=True)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _wait_for_members(settings: Settings, group: str, members: int, timeout: float = 60.0) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka.admin_config())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            desc = admin.describe_consumer_groups([group])[group].result(10)
            if len(desc.members) >= members and str(desc.state).endswith("STABLE"):
                return
        except Exception:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"workers did not join group {group} within {timeout:.0f}s")


# The gateway's part of the demo: a tenant with a tight rate limit, and a model to degrade.
_GREEDY = "tenant-greedy"
_DEMO_GATEWAY_TOML = """
[gateway]
web_port = {web_port}
degrade_load = 0.9

[gateway.downgrade]
"sim-large" = "sim-small"

[gateway.tenant_limits.{greedy}]
per_second = {{ window_ms = 1000, requests = 20 }}
"""


def _start_gateway(settings: Settings, env: dict, workdir: str, web_port: int) -> subprocess.Popen:
    config = os.path.join(workdir, "demo-gateway.toml")
    with open(config, "w") as f:
        f.write(_DEMO_GATEWAY_TOML.format(web_port=web_port, greedy=f'"{_GREEDY}"'))
    log_path = os.path.join(workdir, "gateway.log")
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "--log-level", "INFO", "gateway"],
                            env={**env, "LLMQ_CONFIG": config}, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, cwd=workdir)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        with open(log_path) as f:
            if "Worker]: Ready" in f.read():
                return proc
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    with open(log_path) as f:
        tail = f.read()[-2000:]
    raise RuntimeError(f"the gateway did not start (log {log_path}):\n{tail}")


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def run_demo(settings: Settings, requests: int = 3000, workers: int = 2, sim_latency_ms: float = 20.0,
             keep_broker: bool = False, rate: float = 350.0, gateway: bool = True,
             worker_metrics_port: int = 0) -> int:
    import tempfile

    started_broker = None
    procs: list[subprocess.Popen] = []
    workdir = tempfile.mkdtemp(prefix="llmq-demo-")
    if threading.current_thread() is threading.main_thread():
        # SIGTERM stops the demo the way Ctrl-C does: through the cleanup below, so the gateway
        # and workers it started are stopped too, not left running without their parent.
        signal.signal(signal.SIGTERM, _interrupted)
    try:
        if not broker_answers(settings.kafka.bootstrap):
            b = settings.broker
            host, _, port = settings.kafka.bootstrap.rpartition(":")
            broker = LocalBroker(int(port), b.data_dir, kafka_version=b.kafka_version, heap=b.heap,
                                 cache_dir=b.cache_dir, progress=_say, jvm_options=b.jvm_options)
            _say(f"starting a local Kafka {b.kafka_version} broker at {broker.bootstrap}")
            st = broker.up()
            started_broker = broker
            _say(f"broker answers (log: {st.log_file})")
        else:
            _say(f"using the broker already answering at {settings.kafka.bootstrap}")
        report = create_pipeline_topics(settings)
        _say(f"topics ready ({len(report.created)} created, {len(report.existing)} existed)")

        env = {**os.environ, "LLMQ_BOOTSTRAP": settings.kafka.bootstrap}
        inflight = 2 if gateway else 16
        if gateway:
            web_port = 6066
            procs.append(_start_gateway(settings, env, workdir, web_port))
            _say(f"gateway admitting requests into the dispatch topics (GET http://127.0.0.1:{web_port}/v1/queue; "
                 f"log {workdir}/gateway.log)")
        for i in range(workers):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "--log-level", os.environ.get("LLMQ_DEMO_WORKER_LOG", "WARNING"), "worker",
                 "--sim-latency-ms", str(sim_latency_ms), "--max-inflight", str(inflight), "--worker-id",
                 f"demo-worker-{i}", "--metrics-port", str(worker_metrics_port + i if worker_metrics_port else 0),
                 "--metrics-addr", "127.0.0.1", "--source", "dispatch" if gateway else "requests"],
                env=env, stdin=subprocess.DEVNULL))
        _wait_for_members(settings, settings.worker.group_id, workers)
        capacity = workers * inflight * 1000 / sim_latency_ms
        _say(f"{workers} workers joined group {settings.worker.group_id} (simulated model, {sim_latency_ms:g} ms "
             f"per call, {inflight} in flight each: about {capacity:,.0f} requests/s)")
        mix = _FLOOD_MIX if gateway else _MIX
        _say(f"submitting {requests} requests at {rate:g}/s across {len(_TENANTS) + gateway} tenants and 5 priorities"
             + (f", mostly BACKGROUND: more than the workers can take, so a backlog builds; {_GREEDY} is "
                f"limited to 20 requests/s; 'sim-large' requests may be degraded under load" if gateway else ""))

        rng = random.Random(7)
        bands, weights = zip(*mix.items())
        tenants = _TENANTS + ([_GREEDY] if gateway else [])
        # What to send, drawn up front; each Request is created when it is sent so that
        # its created_at (and so its measured queue wait) starts at submission.
        draws = [(rng.choice(tenants), rng.choice(_PROMPTS), rng.choices(bands, weights)[0],
                  rng.choice((16, 64, 256))) for _ in range(requests)]
        plan: list[Request] = []
        sent_at: dict[str, float] = {}
        latency: dict[Priority, list[float]] = defaultdict(list)
        waits: dict[Priority, list[float]] = defaultdict(list)
        admits: dict[Priority, list[float]] = defaultdict(list)  # created → admitted by the gateway
        outcome: dict[Priority, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        examples: dict[str, list] = defaultdict(list)  # rate_limited / degraded → responses
        lock = threading.Lock()
        with LlmqClient(settings) as client, Progress(requests, "responses") as bar:
            def on_response(req: Request):
                def done(fut):
                    received = time.monotonic()
                    try:
                        resp = fut.result()
                    except Exception:
                        return
                    with lock:
                        latency[req.priority].append((received - sent_at[req.request_id]) * 1000)
                        if resp.started_at is not None:
                            waits[req.priority].append(resp.started_at - resp.created_at)
                        if resp.admitted_at is not None:
                            admits[req.priority].append(resp.admitted_at - resp.created_at)
                        outcome[req.priority][resp.status.value] += 1
                        if (resp.reason or "").startswith("rate_limited"):
                            examples["rate_limited"].append(resp)
                        if resp.degraded:
                            examples["degraded"].append(resp)
                        bar.advance()
                return done

            acks = []
            start = time.monotonic()
            for i, (tenant, prompt, band, max_tokens) in enumerate(draws):
                pause = start + i / rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                # A third of the requests ask for the large model and accept a smaller one under load.
                large = i % 3 == 0
                req = Request.new(tenant, prompt, priority=band, max_tokens=max_tokens, timeout_ms=120_000,
                                  model="sim-large" if large else "sim-small", allow_degrade=large)
                plan.append(req)
                sent_at[req.request_id] = time.monotonic()
                client.response_future(req.request_id).add_done_callback(on_response(req))
                acks.append(client.submit_nowait(req))
            for fut in acks:
                fut.result(60)
            deadline = time.monotonic() + 120
            while bar.done < requests and time.monotonic() < deadline:
                time.sleep(0.05)
        _print_summary(plan, latency, waits, outcome, admits if gateway else None)
        if gateway:
            _print_gateway_effects(examples)
        missing = requests - sum(sum(v.values()) for v in outcome.values())
        if missing:
            print(f"\n{missing} requests got no response within 120 s", file=sys.stderr)
            return 1
        return 0
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        if procs:
            _say("gateway and workers stopped (SIGTERM: drained, committed, left the group)" if gateway
                 else "workers stopped (SIGTERM: drained, committed, left the group)")
        if started_broker is not None and not keep_broker:
            started_broker.down()
            _say("broker stopped")


def _print_gateway_effects(examples: dict) -> None:
    limited = examples.get("rate_limited", [])
    degraded = examples.get("degraded", [])
    print()
    if limited:
        r = limited[0]
        print(f"rate limited: {len(limited)} requests of {r.tenant_id} answered REJECTED, e.g. "
              f"reason={r.reason!r} retry_after_ms={r.retry_after_ms}")
    if degraded:
        r = degraded[0]
        print(f"degraded:     {len(degraded)} 'sim-large' requests served by {r.model!r} under load "
              f"(degraded=true in the response)")


def _print_summary(plan, latency, waits, outcome, admits: dict | None = None) -> None:
    gateway = admits is not None
    counts = defaultdict(int)
    for r in plan:
        counts[r.priority] += 1
    print()
    header = (f"{'priority':<11} {'count':>6} {'completed':>10} {'other':>6} "
              + (f"{'admit p50':>10} " if gateway else "") + f"{'wait p50':>9} {'p50 ms':>8} {'p99 ms':>8}")
    print(header)
    print("-" * len(header))
    for p in Priority:
        done = outcome[p].get(Status.COMPLETED.value, 0)
        other = sum(outcome[p].values()) - done
        print(f"{p.value:<11} {counts[p]:>6} {done:>10} {other:>6} "
              + (f"{_percentile(admits[p], 0.5):>10.1f} " if gateway else "")
              + f"{_percentile(waits[p], 0.5):>9.1f} {_percentile(latency[p], 0.5):>8.1f} "
              f"{_percentile(latency[p], 0.99):>8.1f}")
    all_lat = [x for v in latency.values() for x in v]
    total_done = sum(o.get(Status.COMPLETED.value, 0) for o in outcome.values())
    print("-" * len(header))
    all_waits = [x for v in waits.values() for x in v]
    all_admits = [x for v in (admits or {}).values() for x in v]
    print(f"{'all':<11} {len(plan):>6} {total_done:>10} {len(all_lat) - total_done:>6} "
          + (f"{_percentile(all_admits, 0.5):>10.1f} " if gateway else "")
          + f"{_percentile(all_waits, 0.5):>9.1f} {_percentile(all_lat, 0.5):>8.1f} {_percentile(all_lat, 0.99):>8.1f}")
    print("\n" + ("admit = request created → the gateway admitted it; " if gateway else "")
          + "wait = request created → a worker started it; p50/p99 = submit → response seen by the client.")
    if gateway:
        print("Under a backlog the workers serve higher bands first (lower bands keep a minimum share), so CRITICAL "
              "waits stay short while BACKGROUND waits grow.")
