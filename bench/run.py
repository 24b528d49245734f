"""`make bench`: benchmark scenarios on a real local broker, compared side by side in one run.

Each scenario measures llmq and a baseline on the same broker, same messages, same run,
alternating rounds so machine noise hits both; it reports medians and their ratio.
Results are merged into bench/results.json under ``scenarios.<name>``.

    python bench/run.py                       # every scenario, default sizes
    python bench/run.py --messages 20000 --rounds 3 worker_throughput
    LLMQ_BENCH_BOOTSTRAP=host:port python bench/run.py   # reuse a running broker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402

from pipeline.broker import LocalBroker  # noqa: E402
from pipeline.config import Settings  # noqa: E402
from pipeline.models import Priority, Request  # noqa: E402
from pipeline.serde import Codec  # noqa: E402
from pipeline.topics import TopicSpec, create_pipeline_topics, ensure_topics  # noqa: E402
from pipeline.worker.backends.simulated import SimulatedBackend  # noqa: E402
from pipeline.worker.loop import Worker  # noqa: E402

RESULTS = ROOT / "bench" / "results.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- worker_throughput ------------------------------------------------------------------------


def _fill_requests(settings: Settings, n: int, prompt_bytes: int) -> None:
    codec = Codec.default()
    producer = Producer(settings.kafka.producer_config(**{"linger.ms": 20}))
    prompt = ("lorem ipsum dolor sit amet " * (prompt_bytes // 27 + 1))[:prompt_bytes]
    topic = settings.topics.request_topic(Priority.NORMAL)
    for i in range(n):
        req = Request.new(f"tenant-{i % 50}", prompt, priority=Priority.NORMAL, max_tokens=16,
                          timeout_ms=24 * 3600 * 1000)
        while True:
            try:
                producer.produce(topic, codec.encode_request(req), req.tenant_id.encode())
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    assert producer.flush(60) == 0


def raw_passthrough(settings: Settings, n: int, out_topic: str) -> float:
    """The baseline: consume → produce the same bytes → commit after delivery. No decoding."""
    consumer = Consumer(settings.kafka.consumer_config(f"bench-raw-{uuid.uuid4().hex[:8]}"))
    producer = Producer(settings.kafka.producer_config())
    consumer.subscribe(settings.topics.request_topics)
    delivered = [0]

    def on_delivery(err, msg):
        if err is None:
            delivered[0] += 1

    t0 = None
    consumed = 0
    last_commit = time.monotonic()
    try:
        while delivered[0] < n:
            msgs = consumer.consume(500, 0.005)
            if msgs and t0 is None:
                t0 = time.perf_counter()
            for m in msgs:
                if m.error() is None:
                    consumed += 1
                    producer.produce(out_topic, m.value(), m.key(), on_delivery=on_delivery)
            producer.poll(0)
            if time.monotonic() - last_commit > 0.5:
                # Everything consumed so far is published before its offsets are committed.
                producer.flush()
                consumer.commit(asynchronous=True)
                last_commit = time.monotonic()
        elapsed = time.perf_counter() - t0
    finally:
        producer.flush()
        consumer.close()
    return n / elapsed


def pipeline_worker(settings: Settings, n: int) -> float:
    settings.worker.group_id = f"bench-worker-{uuid.uuid4().hex[:8]}"
    worker = Worker(settings, SimulatedBackend(0.0))
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        while worker.stats.delivered < n:
            time.sleep(0.002)
            if not thread.is_alive():
                raise RuntimeError("worker died")
        return n / (worker.stats.last_delivered_at - worker.stats.first_consumed_at)
    finally:
        worker.stop()
        thread.join(60)


def scenario_worker_throughput(settings: Settings, args) -> dict:
    n = args.messages
    _log(f"worker_throughput: filling {n:,} requests ({args.prompt_bytes} B prompts)")
    _fill_requests(settings, n, args.prompt_bytes)
    out_topic = f"{settings.topics.prefix}.raw-out"
    admin_settings = settings.kafka.admin_config()
    from confluent_kafka.admin import AdminClient

    ensure_topics(AdminClient(admin_settings), [TopicSpec(out_topic, settings.topics.response_partitions, 1)])
    raw, pipe = [], []
    # An untimed pass first: the broker's JIT and page cache warm up on someone else's round.
    _log("  warm-up pass (not counted)")
    raw_passthrough(settings, n, out_topic)
    for r in range(args.rounds):
        raw.append(raw_passthrough(settings, n, out_topic))
        pipe.append(pipeline_worker(settings, n))
        _log(f"  round {r + 1}/{args.rounds}: raw {raw[-1]:,.0f} msg/s   pipeline {pipe[-1]:,.0f} msg/s")
    raw_m, pipe_m = statistics.median(raw), statistics.median(pipe)
    return {"raw_msgs_per_s": round(raw_m), "pipeline_msgs_per_s": round(pipe_m), "ratio": round(pipe_m / raw_m, 3),
            "rounds": args.rounds, "messages": n, "raw_runs": [round(x) for x in raw],
            "pipeline_runs": [round(x) for x in pipe]}


SCENARIOS = {"worker_throughput": scenario_worker_throughput}


def _conditions(args, kafka_version: str) -> dict:
    import confluent_kafka
    import fastavro

    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(),
            "python": platform.python_version(), "confluent_kafka": confluent_kafka.__version__,
            "librdkafka": confluent_kafka.libversion()[0], "fastavro": fastavro.__version__,
            "kafka": kafka_version, "messages": args.messages, "rounds": args.rounds,
            "prompt_bytes": args.prompt_bytes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", choices=[[], *SCENARIOS], default=[],
                        help="which scenarios (default: all)")
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-bytes", type=int, default=512)
    args = parser.parse_args(argv)
    chosen = args.scenarios or list(SCENARIOS)

    base = Settings.load(env={})
    broker = None
    bootstrap = os.environ.get("LLMQ_BENCH_BOOTSTRAP")
    tmp = tempfile.TemporaryDirectory(prefix="llmq-bench-")
    if not bootstrap:
        broker = LocalBroker(_free_port(), Path(tmp.name) / "kafka", kafka_version=base.broker.kafka_version,
                             heap="1g", progress=_log)
        _log(f"starting a benchmark broker at {broker.bootstrap}")
        broker.up()
        bootstrap = broker.bootstrap
    results = {}
    try:
        for name in chosen:
            settings = Settings.load(env={})
            settings.kafka.bootstrap = bootstrap
            settings.topics.prefix = f"bench{uuid.uuid4().hex[:6]}.llm"
            create_pipeline_topics(settings)
            results[name] = SCENARIOS[name](settings, args)
    finally:
        if broker is not None:
            broker.down()
        tmp.cleanup()

    existing = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    existing.setdefault("scenarios", {}).update(results)
    existing["conditions"] = _conditions(args, base.broker.kafka_version)
    RESULTS.write_text(json.dumps(existing, indent=2) + "\n")

    print(f"\n{'scenario':<20} {'llmq':>14} {'baseline':>14} {'ratio':>7}")
    for name, r in results.items():
        llmq = r.get("pipeline_msgs_per_s")
        base_v = r.get("raw_msgs_per_s")
        print(f"{name:<20} {llmq:>10,} /s {base_v:>10,} /s {r['ratio']:>7.3f}")
    print(f"\n(medians of {args.rounds} alternating rounds; written to {RESULTS.relative_to(ROOT)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
