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
import contextlib
import datetime
import json
import os
import platform
import re
import socket
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition  # noqa: E402

from pipeline.broker import LocalBroker  # noqa: E402
from pipeline.config import Settings  # noqa: E402
from pipeline.models import Priority, Request  # noqa: E402
from pipeline.runtime import freeze_long_lived  # noqa: E402
from pipeline.serde import Codec  # noqa: E402
from pipeline.topics import TopicSpec, create_pipeline_topics, ensure_topics  # noqa: E402
from pipeline.worker.backends.simulated import SimulatedBackend  # noqa: E402
from pipeline.worker.loop import Worker  # noqa: E402

from machine import StallWatch, cpu_times, machine_load  # noqa: E402  (bench/, beside this script)

RESULTS = ROOT / "bench" / "results.json"

#: JVM options of the broker this benchmark starts. Empty: the JVM's optimising JIT, as a
#: production broker runs, and G1. The local development broker (``llmq broker up``, tests,
#: demo) keeps the quick tier only (``broker.jvm_options``), which serves a short-lived broker's
#: first minute better; over a benchmark's minutes the optimised code costs the broker about a
#: quarter less CPU per request (BENCHMARKS.md, 2026-12-01 14:50 UTC). A concurrent collector
#: (``-XX:+UseShenandoahGC``) took G1's 5-23 ms young pauses out of a quiet tenant's p99 next to
#: a flooder, but its ~300-ms concurrent cycles on one of the two cores put end_to_end_latency's
#: p99 at 53 ms against 39 (BENCHMARKS.md, 2026-12-01 20:30 UTC): not the default.
BENCH_BROKER_JVM_OPTIONS = os.environ.get("LLMQ_BENCH_BROKER_JVM_OPTIONS", "")
SCALING_TENANTS = 1000
SCALING_MODEL_MS = 40
SCALING_INFLIGHT = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- worker_throughput ------------------------------------------------------------------------


def _fill_requests(settings: Settings, n: int, prompt_bytes: int, tenants: int = 50) -> None:
    """``n`` NORMAL requests from ``tenants`` tenants in turn, encoded first and then produced
    as bytes: building and encoding a request in Python is slower than a worker takes one, so
    where workers consume while this runs (worker_scaling) an encode-as-you-go fill would be
    what is measured."""
    codec = Codec.default()
    prompt = ("lorem ipsum dolor sit amet " * (prompt_bytes // 27 + 1))[:prompt_bytes]
    topic = settings.topics.request_topic(Priority.NORMAL)
    keys = [f"tenant-{t}".encode() for t in range(tenants)]
    values = [codec.encode_request(Request.new(f"tenant-{i % tenants}", prompt, priority=Priority.NORMAL,
                                               max_tokens=16, timeout_ms=24 * 3600 * 1000))
              for i in range(n)]
    producer = Producer(settings.kafka.producer_config(**{"linger.ms": 20}))
    for i, value in enumerate(values):
        while True:
            try:
                producer.produce(topic, value, keys[i % tenants])
                break
            except BufferError:
                producer.poll(0.02)
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
            # The rate comes from the worker's own timestamps, so this thread only needs to
            # notice the end; waking it more often takes the GIL from the worker it measures.
            time.sleep(0.02)
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
    out_topic = _raw_out_topic(settings)
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


# -- worker_exactly_once ----------------------------------------------------------------------


def raw_transactional_passthrough(settings: Settings, n: int, out_topic: str) -> float:
    """The exactly-once baseline: consume → produce the same bytes, and every commit interval one
    transaction with the consumer's positions. No decoding, no per-message bookkeeping."""
    group = f"bench-rawtx-{uuid.uuid4().hex[:8]}"
    consumer = Consumer(settings.kafka.consumer_config(group, **{"isolation.level": "read_committed"}))
    producer = Producer(settings.kafka.producer_config(**{"transactional.id": group}))
    producer.init_transactions(30)
    consumer.subscribe(settings.topics.request_topics)
    interval = settings.worker.commit_interval_ms / 1000
    committed = 0
    pending = 0
    t0 = None
    t_last = 0.0
    try:
        producer.begin_transaction()
        last_commit = time.monotonic()
        while committed < n:
            msgs = consumer.consume(500, 0.005)
            if msgs and t0 is None:
                t0 = time.perf_counter()
            for m in msgs:
                if m.error() is None:
                    producer.produce(out_topic, m.value(), m.key())
                    pending += 1
            producer.poll(0)
            if pending and time.monotonic() - last_commit > interval:
                producer.send_offsets_to_transaction(consumer.position(consumer.assignment()),
                                                     consumer.consumer_group_metadata(), 30)
                producer.commit_transaction(30)
                committed += pending
                pending = 0
                t_last = time.perf_counter()
                producer.begin_transaction()
                last_commit = time.monotonic()
        producer.abort_transaction(30)
    finally:
        consumer.close()
    return committed / (t_last - t0)


def scenario_worker_exactly_once(settings: Settings, args) -> dict:
    n = args.messages
    _log(f"worker_exactly_once: filling {n:,} requests ({args.prompt_bytes} B prompts)")
    _fill_requests(settings, n, args.prompt_bytes)
    out_topic = _raw_out_topic(settings)
    raw, raw_alo, pipe = [], [], []
    _log("  warm-up pass (not counted)")
    raw_transactional_passthrough(settings, n, out_topic)
    for r in range(args.rounds):
        raw.append(raw_transactional_passthrough(settings, n, out_topic))
        raw_alo.append(raw_passthrough(settings, n, out_topic))
        settings.worker.delivery = "exactly-once"
        settings.worker.worker_id = f"bench-eos-{uuid.uuid4().hex[:6]}"
        pipe.append(pipeline_worker(settings, n))
        _log(f"  round {r + 1}/{args.rounds}: raw transactional {raw[-1]:,.0f} msg/s   raw at-least-once "
             f"{raw_alo[-1]:,.0f} msg/s   pipeline exactly-once {pipe[-1]:,.0f} msg/s")
    raw_m, alo_m, pipe_m = statistics.median(raw), statistics.median(raw_alo), statistics.median(pipe)
    return {"raw_msgs_per_s": round(raw_m), "pipeline_msgs_per_s": round(pipe_m), "ratio": round(pipe_m / raw_m, 3),
            "baseline": "raw confluent-kafka transactional passthrough, one transaction per commit interval",
            "commit_interval_ms": settings.worker.commit_interval_ms,
            "raw_at_least_once_msgs_per_s": round(alo_m), "ratio_vs_raw_at_least_once": round(pipe_m / alo_m, 3),
            "rounds": args.rounds, "messages": n, "raw_runs": [round(x) for x in raw],
            "pipeline_runs": [round(x) for x in pipe]}


# -- worker_scaling ---------------------------------------------------------------------------


def _group_members(settings: Settings, group: str) -> int:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka.admin_config())
    try:
        desc = admin.describe_consumer_groups([group])[group].result(10)
    except (KafkaException, TimeoutError):  # the coordinator loads (a fresh broker's first group): ask again
        return 0
    if str(desc.state).split(".")[-1] != "STABLE":
        return 0
    return sum(1 for m in desc.members if m.assignment.topic_partitions)


def _worker_processes(settings: Settings, count: int, n: int, prompt_bytes: int, **worker: str) -> float:
    """``count`` worker processes in one group, joined before any request exists; the rate is
    n / (last response − first response), from the responses' broker timestamps. ``worker``:
    more worker settings (LLMQ_WORKER__<KEY>)."""
    group = f"bench-scale-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "LLMQ_BOOTSTRAP": settings.kafka.bootstrap, "LLMQ_TOPICS__PREFIX": settings.topics.prefix,
           "LLMQ_WORKER__GROUP_ID": group, "LLMQ_WORKER__METRICS_PORT": "0",
           **{f"LLMQ_WORKER__{k.upper()}": v for k, v in worker.items()}}
    procs = [subprocess.Popen([sys.executable, "-m", "pipeline.cli", "--log-level", "WARNING", "worker",
                               "--worker-id", f"{group}-{i}"], env=env, stdin=subprocess.DEVNULL)
             for i in range(count)]
    try:
        deadline = time.monotonic() + 60
        while _group_members(settings, group) < count:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{count} workers did not join group {group}")
            time.sleep(0.5)
        # Many tenants: 50 tenant keys put 68 % of the requests on partitions 0-2 of 6, so
        # the worker holding those would set the pace, not the number of workers.
        _fill_requests(settings, n, prompt_bytes, tenants=SCALING_TENANTS)
        return n / _response_span_s(settings, n)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(60)


def _response_span_s(settings: Settings, n: int, timeout: float = 300.0) -> float:
    from confluent_kafka import OFFSET_BEGINNING

    topic = settings.topics.responses
    consumer = Consumer({"bootstrap.servers": settings.kafka.bootstrap, "group.id": f"bench-span-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "enable.partition.eof": False})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        first, last, seen = None, None, 0
        deadline = time.monotonic() + timeout
        while seen < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {seen:,} of {n:,} responses within {timeout:.0f} s")
            for m in consumer.consume(1000, 0.5):
                if m.error() is None:
                    seen += 1
                    ts = m.timestamp()[1]
                    first = ts if first is None else min(first, ts)
                    last = ts if last is None else max(last, ts)
        return max(last - first, 1) / 1000
    finally:
        consumer.close()


def _one_vs_two(settings: Settings, rounds: int, n: int, prompt_bytes: int, label: str, **worker: str):
    one, two = [], []
    for r in range(rounds):
        for count, into in ((1, one), (2, two)):
            # Fresh topics each time: each run's responses are only its own.
            settings.topics.prefix = f"bench{uuid.uuid4().hex[:6]}.llm"
            create_pipeline_topics(settings)
            into.append(_worker_processes(settings, count, n, prompt_bytes, **worker))
        _log(f"  {label} round {r + 1}/{rounds}: one worker {one[-1]:,.0f} msg/s   two workers {two[-1]:,.0f} msg/s")
    return one, two


def scenario_worker_scaling(settings: Settings, args) -> dict:
    n = args.messages
    one, two = _one_vs_two(settings, args.rounds, n, args.prompt_bytes, "0-ms model:")
    one_m, two_m = statistics.median(one), statistics.median(two)
    # LLM workers wait on the model, not on the CPU: a model taking SCALING_MODEL_MS a call,
    # SCALING_INFLIGHT calls at a time per worker, is what a second worker should double.
    m_rounds = min(args.rounds, 3)
    m_n = SCALING_INFLIGHT * 1000 // SCALING_MODEL_MS * 8  # about 8 s for one worker
    m_one, m_two = _one_vs_two(settings, m_rounds, m_n, args.prompt_bytes, f"{SCALING_MODEL_MS}-ms model:",
                               sim_latency_ms=str(SCALING_MODEL_MS), max_inflight=str(SCALING_INFLIGHT))
    m_one_m, m_two_m = statistics.median(m_one), statistics.median(m_two)
    return {"one_worker_msgs_per_s": round(one_m), "two_workers_msgs_per_s": round(two_m),
            "ratio": round(two_m / one_m, 3), "cpus": os.cpu_count(), "rounds": args.rounds, "messages": n,
            "one_worker_runs": [round(x) for x in one], "two_workers_runs": [round(x) for x in two],
            "tenants": SCALING_TENANTS,
            "note": "0-ms model: the workers and the broker share the machine's cores",
            "model_bound": {"model_ms": SCALING_MODEL_MS, "max_inflight": SCALING_INFLIGHT, "messages": m_n,
                            "rounds": m_rounds, "one_worker_msgs_per_s": round(m_one_m),
                            "two_workers_msgs_per_s": round(m_two_m), "ratio": round(m_two_m / m_one_m, 3),
                            "one_worker_runs": [round(x) for x in m_one],
                            "two_workers_runs": [round(x) for x in m_two]}}


def _raw_out_topic(settings: Settings) -> str:
    from confluent_kafka.admin import AdminClient

    out_topic = f"{settings.topics.prefix}.raw-out"
    ensure_topics(AdminClient(settings.kafka.admin_config()),
                  [TopicSpec(out_topic, settings.topics.response_partitions, 1)])
    return out_topic


SCENARIOS = {"worker_throughput": scenario_worker_throughput, "worker_exactly_once": scenario_worker_exactly_once,
             "worker_scaling": scenario_worker_scaling}

def _gateway_scenarios() -> dict:
    import gateway_bench as gb

    return {
        "gateway_throughput": lambda settings, args: gb.gateway_throughput(settings, args, raw_passthrough,
                                                                           _fill_requests),
        "rate_limit_accuracy": gb.rate_limit_accuracy,
        "priority_isolation": gb.priority_isolation,
        "tenant_fairness": gb.tenant_fairness,
        "end_to_end_latency": gb.end_to_end_latency,
        "gateway_memory": gb.gateway_memory,
    }


SCENARIOS.update(_gateway_scenarios())

# Which figure is llmq's, which the baseline's, and what the ratio compares, for the table.
TABLE = {
    "worker_throughput": ("pipeline_msgs_per_s", "raw_msgs_per_s", "worker vs raw passthrough"),
    "worker_exactly_once": ("pipeline_msgs_per_s", "raw_msgs_per_s", "exactly-once worker vs raw transactional"),
    "worker_scaling": ("two_workers_msgs_per_s", "one_worker_msgs_per_s", "two worker processes vs one"),
    "gateway_throughput": ("gateway_msgs_per_s", "raw_msgs_per_s", "admitted/s vs raw passthrough"),
}


# Topics the scenarios create: "bench<hex>.llm…" here, "gwb<hex>.llm…" in gateway_bench.
_BENCH_TOPIC = re.compile(r"^(bench|gwb)[0-9a-f]{6}\.llm")


def _drop_bench_topics(bootstrap: str, log_dir: Path | None = None) -> None:
    """Delete the topics a scenario created, so that the next one runs on a broker without
    hundreds of dead partitions (their indexes and fetch sessions cost the broker CPU and the
    later scenarios latency). Only names the benchmark generates are touched.

    With the broker's ``log_dir`` (a broker this run started), also wait until the broker has
    removed their files: it unlinks them on a scheduler thread, which took 30-50 % of a core for
    seconds, and with Kafka's default delay of a minute that was in the middle of the scenario
    after next (the local broker deletes them after a second, ``log.segment.delete.delay.ms``)."""
    from confluent_kafka.admin import AdminClient

    from gateway_bench import delete_topics

    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = [t for t in admin.list_topics(timeout=30).topics if _BENCH_TOPIC.match(t)]
    if not names:
        return
    deadline = delete_topics(admin, names)
    # A deleted partition's directory is renamed "<topic>-<partition>.<id>-delete" until removed.
    while log_dir is not None and time.monotonic() < deadline and any(log_dir.glob("*-delete")):
        time.sleep(0.2)
    _log(f"  deleted the scenario's {len(names)} topics")


def _warm_broker(bootstrap: str, seconds: float) -> None:
    """Traffic of the kinds the scenarios send, before the first one is measured: bulk batches,
    and single small messages over many partitions (a produce request and a fetch each), read
    back by a consumer. The optimising JIT compiles the broker's request paths during its first
    minutes of traffic, at up to a core of CPU; measured meanwhile, that is neither llmq's cost
    nor a baseline's, and it would hit whichever ran first."""
    settings = Settings.load(env={})
    settings.kafka.bootstrap = bootstrap
    from confluent_kafka.admin import AdminClient

    topic = f"bench{uuid.uuid4().hex[:6]}.llm.broker-warm-up"
    ensure_topics(AdminClient(settings.kafka.admin_config()), [TopicSpec(topic, 12, 1)])
    stop = threading.Event()
    read = [0]

    def consume() -> None:
        consumer = Consumer(settings.kafka.consumer_config(f"bench-warm-{uuid.uuid4().hex[:8]}",
                                                           **{"fetch.wait.max.ms": 5}))
        consumer.subscribe([topic])
        try:
            while not stop.is_set():
                read[0] += len(consumer.consume(1000, 0.05))
        finally:
            consumer.close()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    bulk = Producer(settings.kafka.producer_config(**{"linger.ms": 20}))
    single = Producer(settings.kafka.producer_config(**{"linger.ms": 1}))
    value = b"x" * 200
    sent = 0
    t0 = last_report = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            for i in range(20_000):
                while True:
                    try:
                        bulk.produce(topic, value, str(i % 50).encode())
                        break
                    except BufferError:
                        bulk.poll(0.01)
            bulk.poll(0)
            second = time.monotonic()
            for i in range(1000):
                single.produce(topic, value, str(i).encode())
                single.poll(0)
                time.sleep(max(0.0, second + (i + 1) / 1000 - time.monotonic()))
            sent += 21_000
            if time.monotonic() - last_report >= 15:
                _log(f"  warming the broker: {time.monotonic() - t0:.0f}/{seconds:.0f} s, {sent:,} sent, {read[0]:,} read")
                last_report = time.monotonic()
        bulk.flush(60)
        single.flush(60)
    finally:
        stop.set()
        reader.join(30)


def _conditions(args, kafka_version: str, own_broker: bool) -> dict:
    import confluent_kafka
    import fastavro

    from pipeline.serde import fastpath

    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(),
            "python": platform.python_version(), "confluent_kafka": confluent_kafka.__version__,
            "librdkafka": confluent_kafka.libversion()[0], "fastavro": fastavro.__version__,
            "kafka": kafka_version, "messages": args.messages, "rounds": args.rounds,
            "prompt_bytes": args.prompt_bytes, "native_codec": fastpath.native_available(),
            "broker_jvm_options": BENCH_BROKER_JVM_OPTIONS if own_broker else "(a broker this run did not start)",
            "broker_warm_up_s": args.broker_warm_up}


_GC_PAUSE = re.compile(r"^\[(?P<at>[^\]]+)\] GC\(\d+\) Pause .* (?P<ms>[\d.]+)ms$")


def broker_pauses(gc_log: Path, start: float, end: float) -> dict:
    """The benchmark broker's stop-the-world pauses between ``start`` and ``end`` (epoch
    seconds), from its ``-Xlog:gc:...:time`` log: every latency scenario's tail moves with them
    (BENCHMARKS.md), so each scenario's result says how many it ran through."""
    pauses = []
    with contextlib.suppress(OSError):
        for line in gc_log.read_text().splitlines():
            m = _GC_PAUSE.match(line.strip())
            try:
                at = datetime.datetime.strptime(m["at"], "%Y-%m-%dT%H:%M:%S.%f%z").timestamp() if m else None
            except ValueError:  # another decoration than ``time``: this figure is lost, not the run
                at = None
            if at is not None and start <= at <= end:
                pauses.append(float(m["ms"]))
    return {"pauses": len(pauses), "total_ms": round(sum(pauses)), "max_ms": round(max(pauses, default=0.0), 1),
            "over_20_ms": sum(p > 20 for p in pauses)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", choices=[[], *SCENARIOS], default=[],
                        help="which scenarios (default: all)")
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-bytes", type=int, default=512)
    parser.add_argument("--broker-warm-up", type=float, default=60, metavar="SECONDS",
                        help="traffic through the broker this run starts before the first scenario, while "
                             "its JIT compiles (default 60; 0: none)")
    args = parser.parse_args(argv)
    chosen = args.scenarios or list(SCENARIOS)
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C: the scenario's processes and the
    # broker this run started are stopped in the finally blocks instead of being left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    base = Settings.load(env={})
    broker = None
    bootstrap = os.environ.get("LLMQ_BENCH_BOOTSTRAP")
    tmp = tempfile.TemporaryDirectory(prefix="llmq-bench-")
    if not bootstrap:
        jvm_options = BENCH_BROKER_JVM_OPTIONS
        gc_log = Path(tmp.name) / "broker-gc.log"
        broker = LocalBroker(_free_port(), Path(tmp.name) / "kafka", kafka_version=base.broker.kafka_version,
                             heap="1g", progress=_log, jvm_options=f"{jvm_options} -Xlog:gc:file={gc_log}:time".strip())
        _log(f"starting a benchmark broker at {broker.bootstrap} (JVM options: {jvm_options or 'none'})")
        broker.up()
        bootstrap = broker.bootstrap
    # As `llmq worker` does at start (the workers measured here run in this process).
    freeze_long_lived("bench")
    results = {}
    watch = StallWatch(Path(tmp.name) / "stalls.log")
    try:
        if broker is not None and args.broker_warm_up > 0:
            _log(f"warming the broker for {args.broker_warm_up:.0f} s")
            try:
                _warm_broker(bootstrap, args.broker_warm_up)
            finally:
                _drop_bench_topics(bootstrap, broker.data_dir / "data")
        for name in chosen:
            settings = Settings.load(env={})
            settings.kafka.bootstrap = bootstrap
            settings.topics.prefix = f"bench{uuid.uuid4().hex[:6]}.llm"
            create_pipeline_topics(settings)
            started, cpu_before = time.time(), cpu_times()
            try:
                results[name] = SCENARIOS[name](settings, args)
                results[name]["machine"] = {**machine_load(cpu_before, cpu_times()),
                                            **watch.stalls(started, time.time())}
                if broker is not None:
                    results[name]["broker_gc"] = broker_pauses(gc_log, started, time.time())
            finally:
                _drop_bench_topics(bootstrap, broker.data_dir / "data" if broker is not None else None)
    finally:
        watch.stop()
        if broker is not None:
            broker.down()
        tmp.cleanup()

    existing = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    existing.setdefault("scenarios", {}).update(results)
    existing["conditions"] = _conditions(args, base.broker.kafka_version, broker is not None)
    RESULTS.write_text(json.dumps(existing, indent=2) + "\n")

    print(f"\n{'scenario':<20} {'llmq':>14} {'baseline':>14} {'ratio':>7}   compared")
    for name, r in results.items():
        if name in TABLE:
            llmq_key, base_key, what = TABLE[name]
            print(f"{name:<20} {r[llmq_key]:>10,} /s {r[base_key]:>10,} /s {r['ratio']:>7.3f}   {what}")
    for name, r in results.items():
        if name not in TABLE:
            shown = {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            print(f"{name:<20} " + "  ".join(f"{k}={v}" for k, v in list(shown.items())[:6]))
    print(f"\n(medians of {args.rounds} alternating rounds; written to {RESULTS.relative_to(ROOT)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
