"""`make bench`: benchmark scenarios on a real local broker, compared side by side in one run.

Each scenario measures llmq and a baseline on the same broker, same messages, same run,
alternating rounds so machine noise hits both; it reports medians and their ratio.
Results are merged into bench/results.json under ``scenarios.<name>``.

    python bench/run.py                       # every scenario, default sizes
    python bench/run.py --rounds 3 priority_isolation tenant_fairness
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
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from confluent_kafka import Consumer, KafkaException, Producer  # noqa: E402

from pipeline.broker import LocalBroker, free_port  # noqa: E402
from pipeline.config import Settings  # noqa: E402
from pipeline.models import Priority, Request  # noqa: E402
from pipeline.runtime import freeze_long_lived  # noqa: E402
from pipeline.serde import Codec  # noqa: E402
from pipeline.topics import TopicSpec, create_pipeline_topics, ensure_topics  # noqa: E402

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
SCALING_MODEL_MS = 40
SCALING_INFLIGHT = 16


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
    """The baseline: consume → produce the same bytes, nothing decoded, nothing decided, nothing
    waited for along the way (offsets committed once, at the end, after the last delivery): the
    fastest a Python process moves these records from topic to topic through librdkafka."""
    consumer = Consumer(settings.kafka.consumer_config(f"bench-raw-{uuid.uuid4().hex[:8]}"))
    producer = Producer(settings.kafka.producer_config())
    consumer.subscribe(settings.topics.request_topics)
    delivered = [0]

    def on_delivery(err, msg):
        if err is None:
            delivered[0] += 1

    t0 = None
    try:
        while delivered[0] < n:
            msgs = consumer.consume(1000, 0.005)
            if msgs and t0 is None:
                t0 = time.perf_counter()
            for m in msgs:
                if m.error() is None:
                    while True:
                        try:
                            producer.produce(out_topic, m.value(), m.key(), on_delivery=on_delivery)
                            break
                        except BufferError:
                            producer.poll(0.001)
            producer.poll(0)
        elapsed = time.perf_counter() - t0
    finally:
        producer.flush()
        with contextlib.suppress(KafkaException):
            consumer.commit(asynchronous=False)
        consumer.close()
    return n / elapsed


def _raw_out_topic(settings: Settings) -> str:
    from confluent_kafka.admin import AdminClient

    out_topic = f"{settings.topics.prefix}.raw-out"
    ensure_topics(AdminClient(settings.kafka.admin_config()),
                  [TopicSpec(out_topic, settings.topics.response_partitions, 1)])
    return out_topic


def _scenarios() -> dict:
    """Every scenario, by name; a module that cannot be imported leaves its scenarios out, said."""
    import gateway_bench as gb

    out = {
        "gateway_throughput": lambda settings, args: gb.gateway_throughput(settings, args, raw_passthrough,
                                                                           _fill_requests),
        "rate_limit_accuracy": gb.rate_limit_accuracy,
        "priority_isolation": gb.priority_isolation,
        "tenant_fairness": gb.tenant_fairness,
        "end_to_end_latency": gb.end_to_end_latency,
        "gateway_memory": gb.gateway_memory,
    }
    for module, names in (("failover_bench", ("gateway_failover",)),
                          ("backend_bench", ("backend_utilization", "streaming_ttft")),
                          ("serve_bench", ("serve_overhead",)),
                          ("eta_bench", ("eta_accuracy",)),
                          ("cost_bench", ("cpu_per_request", "load_curve")),
                          ("batch_bench", ("batch_beside_interactive",)),
                          ("prefix_bench", ("prefix_routing",))):
        try:
            mod = __import__(module)
        except ImportError as exc:
            _log(f"({module} not available: {exc}; {', '.join(names)} left out)")
            continue
        out.update({name: getattr(mod, name) for name in names if hasattr(mod, name)})
    return out


SCENARIOS = _scenarios()

# Topics the scenarios create: "bench<hex>.llm…" here, "gwb<hex>.llm…" in gateway_bench.
_BENCH_TOPIC = re.compile(r"^(bench|gwb)[0-9a-f]{6}\.llm")

# Which figure is llmq's, which the baseline's, and what the ratio compares, for the table.
TABLE = {
    "gateway_throughput": ("gateway_msgs_per_s", "raw_msgs_per_s", "admitted/s vs raw passthrough"),
}


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
    import faust

    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(),
            "python": platform.python_version(), "confluent_kafka": confluent_kafka.__version__,
            "librdkafka": confluent_kafka.libversion()[0], "fastavro": fastavro.__version__,
            "faust_streaming": faust.__version__,
            "kafka": kafka_version, "messages": args.messages, "rounds": args.rounds,
            "prompt_bytes": args.prompt_bytes,
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
    # `[]` is among the choices only because argparse checks an empty nargs="*" default against them.
    parser.add_argument("scenarios", nargs="*", choices=[[], *SCENARIOS], default=[], metavar="SCENARIO",
                        help=f"which scenarios (default: all): {', '.join(SCENARIOS)}")
    parser.add_argument("--messages", type=int, default=100_000,
                        help="requests a throughput scenario writes (gateway_throughput caps it at 30,000)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating rounds of llmq and its baseline, where a scenario takes the count")
    parser.add_argument("--prompt-bytes", type=int, default=512, help="prompt size of the generated requests")
    parser.add_argument("--kills", type=int, default=5,
                        help="gateway_failover: gateways SIGKILLed one after another (default 5, at least 3)")
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
        broker = LocalBroker(free_port(), Path(tmp.name) / "kafka", kafka_version=base.broker.kafka_version,
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
                results[name]["run_at"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
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
    # A scenario this run did not make is kept from an earlier one; one that no longer exists is not.
    existing["scenarios"] = {k: v for k, v in existing.get("scenarios", {}).items() if k in SCENARIOS}
    existing["scenarios"].update(results)
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
