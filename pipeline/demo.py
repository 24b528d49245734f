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


def run_demo(settings: Settings, requests: int = 2000, workers: int = 2, sim_latency_ms: float = 20.0,
             keep_broker: bool = False) -> int:
    started_broker = None
    procs: list[subprocess.Popen] = []
    try:
        if not broker_answers(settings.kafka.bootstrap):
            b = settings.broker
            host, _, port = settings.kafka.bootstrap.rpartition(":")
            broker = LocalBroker(int(port), b.data_dir, kafka_version=b.kafka_version, heap=b.heap,
                                 cache_dir=b.cache_dir, progress=_say)
            _say(f"starting a local Kafka {b.kafka_version} broker at {broker.bootstrap}")
            st = broker.up()
            started_broker = broker
            _say(f"broker answers (log: {st.log_file})")
        else:
            _say(f"using the broker already answering at {settings.kafka.bootstrap}")
        report = create_pipeline_topics(settings)
        _say(f"topics ready ({len(report.created)} created, {len(report.existing)} existed)")

        env = {**os.environ, "LLMQ_BOOTSTRAP": settings.kafka.bootstrap}
        for i in range(workers):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "--log-level", "WARNING", "worker",
                 "--sim-latency-ms", str(sim_latency_ms), "--max-inflight", "16", "--worker-id", f"demo-worker-{i}"],
                env=env, stdin=subprocess.DEVNULL))
        _say(f"started {workers} workers (simulated model, {sim_latency_ms:g} ms per call, 16 in flight each)")

        rng = random.Random(7)
        bands, weights = zip(*_MIX.items())
        plan = [Request.new(rng.choice(_TENANTS), rng.choice(_PROMPTS), priority=rng.choices(bands, weights)[0],
                            max_tokens=rng.choice((16, 64, 256)), timeout_ms=120_000)
                for _ in range(requests)]
        sent_at: dict[str, float] = {}
        latency: dict[Priority, list[float]] = defaultdict(list)
        outcome: dict[Priority, dict[str, int]] = defaultdict(lambda: defaultdict(int))
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
                        outcome[req.priority][resp.status.value] += 1
                        bar.advance()
                return done

            acks = []
            for req in plan:
                sent_at[req.request_id] = time.monotonic()
                client._engine.expect(req.request_id).add_done_callback(on_response(req))
                acks.append(client.submit_nowait(req))
            for fut in acks:
                fut.result(60)
            deadline = time.monotonic() + 120
            while bar.done < requests and time.monotonic() < deadline:
                time.sleep(0.05)
        _print_summary(plan, latency, outcome)
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
            _say("workers stopped (SIGTERM: drained, committed, left the group)")
        if started_broker is not None and not keep_broker:
            started_broker.down()
            _say("broker stopped")


def _print_summary(plan, latency, outcome) -> None:
    counts = defaultdict(int)
    for r in plan:
        counts[r.priority] += 1
    print()
    header = f"{'priority':<11} {'count':>6} {'completed':>10} {'other':>6} {'p50 ms':>8} {'p99 ms':>8}"
    print(header)
    print("-" * len(header))
    for p in Priority:
        done = outcome[p].get(Status.COMPLETED.value, 0)
        other = sum(outcome[p].values()) - done
        print(f"{p.value:<11} {counts[p]:>6} {done:>10} {other:>6} "
              f"{_percentile(latency[p], 0.5):>8.1f} {_percentile(latency[p], 0.99):>8.1f}")
    all_lat = [x for v in latency.values() for x in v]
    total_done = sum(o.get(Status.COMPLETED.value, 0) for o in outcome.values())
    print("-" * len(header))
    print(f"{'all':<11} {len(plan):>6} {total_done:>10} {len(all_lat) - total_done:>6} "
          f"{_percentile(all_lat, 0.5):>8.1f} {_percentile(all_lat, 0.99):>8.1f}")
    print("\nlatency = submit → response seen by the client. Priority-aware scheduling arrives with the "
          "gateway and worker pools; here every band shares one worker group.")
