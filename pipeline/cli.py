"""`llmq`: the command line of the llmq pipeline.

Every command reads the same settings: defaults, then ``--config FILE`` (or
``$LLMQ_CONFIG``), then ``LLMQ_*`` environment variables, then flags. The global options
(``--config``, ``--bootstrap``, ``--log-level``) go before or after the command.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pipeline import DISTRIBUTION
from pipeline.config import Settings
from pipeline.errors import LlmqError

log = logging.getLogger("llmq")

_EPILOG = """\
environment:
  LLMQ_BOOTSTRAP            Kafka bootstrap servers (default 127.0.0.1:9092)
  LLMQ_CONFIG               settings file (TOML); see deploy/llmq.toml for every key
  LLMQ_<SECTION>__<KEY>     any setting, e.g. LLMQ_WORKER__MAX_INFLIGHT=32
  LLMQ_RDKAFKA_<NAME>       a librdkafka property, '_' read as '.', e.g. LLMQ_RDKAFKA_LINGER_MS=10
  LLMQ_CACHE_DIR            where the Kafka jars are cached (default ~/.cache/llmq)

quick start:
  llmq broker up && llmq topics create && llmq worker &
  llmq submit --tenant acme --priority high "Summarise the Kafka docs"

`llmq COMMAND --help` explains each command.
"""

_LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        from pipeline import __version__

        return __version__


def _settings(args) -> Settings:
    settings = Settings.load(args.config)
    if getattr(args, "bootstrap", None):
        settings.kafka.bootstrap = args.bootstrap
    return settings


def _print_json(doc) -> None:
    print(json.dumps(doc, default=str))


def _broker(args, settings: Settings):
    from pipeline.broker import LocalBroker

    b = settings.broker
    return LocalBroker(args.port or b.port, args.data_dir or b.data_dir, kafka_version=b.kafka_version,
                       heap=b.heap, cache_dir=b.cache_dir, progress=lambda m: print(m, file=sys.stderr),
                       secure=getattr(args, "secure", False), jvm_options=b.jvm_options)


def _cluster(args, settings: Settings):
    """The local cluster the arguments name: --nodes > 1, or a data dir that holds one."""
    from pipeline.cluster import LocalCluster

    b = settings.broker
    nodes = args.nodes or b.nodes
    data_dir = args.data_dir or b.data_dir
    if nodes <= 1 and not LocalCluster.exists(data_dir):
        return None
    options = dict(kafka_version=b.kafka_version, heap=b.heap, cache_dir=b.cache_dir, jvm_options=b.jvm_options,
                   progress=lambda m: print(m, file=sys.stderr))
    if getattr(args, "secure", False):
        raise LlmqError("--secure runs a single broker; a local cluster is PLAINTEXT")
    if LocalCluster.exists(data_dir) and not args.nodes:
        return LocalCluster.at(data_dir, **options)
    return LocalCluster(nodes, args.port or b.port, data_dir, **options)


def cmd_cluster(args, cluster) -> int:
    if args.action == "up":
        st = cluster.up()
        pids = ", ".join(f"{i}: {s.pid}" for i, s in st.nodes.items())
        print(f"Kafka cluster up: {len(st.nodes)} nodes at {st.bootstrap} (PLAINTEXT; pids {pids}; data {cluster.data_dir})")
        print("# topics: replication factor {0}, min.insync.replicas {1}".format(
            cluster.replication_factor, next(iter(cluster.nodes.values())).node.min_isr))
        for k, v in cluster.client_env().items():
            print(f"export {k}={v}")
        return 0
    if args.action == "status":
        st = cluster.status()
        states = {i: "answering" if s.running else ("process running, not answering" if s.pid else "not running")
                  for i, s in st.nodes.items()}
        if args.json:
            _print_json({"bootstrap": st.bootstrap, "answering": st.running, "registered": st.registered,
                         "nodes": [{"node_id": i, "bootstrap": s.bootstrap, "state": states[i], "pid": s.pid,
                                    "data_dir": str(s.data_dir), "log_file": str(s.log_file)}
                                   for i, s in st.nodes.items()]})
        else:
            print(f"Kafka cluster at {st.bootstrap}: {len(st.registered)} of {len(st.nodes)} brokers registered")
            for i, s in st.nodes.items():
                print(f"  node {i} {s.bootstrap}: {states[i]} (pid {s.pid or '-'}, log {s.log_file})")
        return 0 if st.running else 1
    if args.action == "down":
        was = cluster.down()
        print(f"Kafka cluster at {cluster.bootstrap}: {'stopped' if was else 'was not running'}")
        return 0
    raise AssertionError(args.action)


def cmd_broker(args) -> int:
    from pipeline.broker import fetch_jars

    settings = _settings(args)
    if args.action == "fetch":
        path = fetch_jars(settings.broker.kafka_version, settings.broker.cache_dir,
                          progress=lambda m: print(m, file=sys.stderr, flush=True))
        print(f"Kafka {settings.broker.kafka_version} jars: {path}")
        return 0
    cluster = _cluster(args, settings)
    if cluster is not None:
        return cmd_cluster(args, cluster)
    broker = _broker(args, settings)
    if args.action == "up":
        st = broker.up()
        mode = "SASL_SSL + SCRAM-SHA-512 + ACLs" if broker.is_secure() else "PLAINTEXT"
        print(f"Kafka broker up at {st.bootstrap} ({mode}; pid {st.pid}, data {st.data_dir}, log {st.log_file})")
        if broker.is_secure():
            print(f"# password files (0600) in {broker.secrets_dir}; apply the role ACLs with `llmq acls --apply`.")
            print("# an llmq process acting as ROLE (producer, gateway, worker, consumer, client, lagexporter):")
            for k, v in broker.client_env("ROLE").items():
                print(f"export {k}={v}")
        else:
            print(f"export LLMQ_BOOTSTRAP={st.bootstrap}")
        return 0
    if args.action == "status":
        st = broker.status()
        state = "answering" if st.running else ("process running, not answering" if st.pid else "not running")
        if args.json:
            _print_json({"bootstrap": st.bootstrap, "state": state, "answering": st.running, "pid": st.pid,
                         "secure": broker.is_secure(), "data_dir": str(st.data_dir), "log_file": str(st.log_file)})
        else:
            print(f"Kafka broker at {st.bootstrap}: {state}")
            print(f"  pid:      {st.pid or '-'}")
            print(f"  data dir: {st.data_dir}")
            print(f"  log file: {st.log_file}")
        return 0 if st.running else 1
    if args.action == "down":
        was = broker.down()
        print(f"Kafka broker at {broker.bootstrap}: {'stopped' if was else 'was not running'}")
        return 0
    raise AssertionError(args.action)


def cmd_topics(args) -> int:
    from pipeline.topics import create_pipeline_topics

    settings = _settings(args)
    report = create_pipeline_topics(settings, strict=False)
    if args.json:
        _print_json({"ok": report.ok, "created": report.created, "existing": report.existing,
                     "mismatched": [{"topic": t, "configured_partitions": want, "broker_partitions": have}
                                    for t, want, have in report.mismatched]})
    else:
        print(report.describe())
    if not report.ok:
        print("\nSome existing topics differ from the configuration (see MISMATCH above). llmq never "
              "changes an existing topic's partition count: adding partitions remaps tenants' keys. "
              "Adjust topics.*_partitions or recreate the topics.", file=sys.stderr)
        return 2
    return 0


def cmd_worker(args) -> int:
    from pipeline.observability.metrics import serve
    from pipeline.runtime import freeze_long_lived
    from pipeline.worker.backends.factory import make_backend
    from pipeline.worker.health import worker_health
    from pipeline.worker.loop import Worker

    settings = _settings(args)
    w = settings.worker
    for name in ("sim_latency_ms", "sim_ms_per_token", "max_inflight", "group_id", "worker_id", "metrics_port",
                 "metrics_addr", "pool", "backend", "openai_base_url", "delivery", "source"):
        value = getattr(args, name)
        if value is not None:
            setattr(w, name, value)
    settings.validate()
    backend = make_backend(w, settings.models)
    topics = args.topics.split(",") if args.topics else None
    worker = Worker(settings, backend, topics=topics, weights=_tenant_weights(settings))
    if serve(worker.metrics.registry, w.metrics_port, w.metrics_addr, health=worker_health(worker)):
        log.info("metrics on http://%s:%d/metrics, health on /healthz and /readyz", w.metrics_addr, w.metrics_port)
    freeze_long_lived("worker")
    worker.run()
    return 0


def _tenant_weights(settings):
    """The tenant registry's ``weight`` of each tenant, read live (fair queuing's shares)."""
    from pipeline.errors import LlmqError
    from pipeline.tenants.registry import TenantRegistry

    registry = TenantRegistry(settings)
    try:
        registry.start(wait_s=15.0)
    except LlmqError as exc:
        log.warning("%s: tenants' weights come from the configuration and the registry file only", exc)

    def weight(tenant: str) -> float:
        record = registry.get(tenant)
        return record.weight if record is not None else 1.0

    return weight


def cmd_gateway(args) -> int:
    from pipeline.gateway.app import Gateway

    settings = _settings(args)
    if args.web_port is not None:
        settings.gateway.web_port = args.web_port
    if args.app_id:
        settings.gateway.app_id = args.app_id
    if args.instance_id:
        settings.gateway.instance_id = args.instance_id
    settings.validate()
    gateway = Gateway(settings)
    log.info("gateway %s admitting from %s.requests.* to %s.dispatch.* (web port %s)", settings.gateway.app_id,
             settings.topics.prefix, settings.topics.prefix, settings.gateway.web_port or "off")
    gateway.run(args.log_level)
    return 0


def cmd_submit(args) -> int:
    from pipeline.client import LlmqClient
    from pipeline.models import Priority, Request

    settings = _settings(args)
    try:
        priority = Priority.parse(args.priority)
    except ValueError as exc:
        raise SystemExit(f"llmq submit: {exc}")
    if args.via:
        from pipeline.serve.http_submit import submit_via

        return submit_via(args.via, args.key_file, args.prompt, priority=priority, model=args.model,
                          max_tokens=args.max_tokens, timeout_s=args.timeout, wait=not args.no_wait,
                          as_json=args.json)
    if not args.tenant:
        raise SystemExit("llmq submit: --tenant is required (or --via URL --key-file FILE, where the key names it)")
    request = Request.new(args.tenant, args.prompt, priority=priority, model=args.model,
                          max_tokens=args.max_tokens, timeout_ms=int(args.timeout * 1000))
    with LlmqClient(settings, listen=not args.no_wait) as client:
        sub = client.submit(request, track=not args.no_wait)
        print(f"submitted {request.request_id} to {sub.topic}[{sub.partition}]@{sub.offset}", file=sys.stderr)
        if args.no_wait:
            print(request.request_id)
            return 0
        response = client.result(request.request_id, timeout=args.timeout)
    if args.json:
        print(json.dumps(response.to_record(), default=str))
    else:
        print(f"{response.status.value}: {response.output if response.output is not None else response.reason}")
    return 0 if response.status.value == "COMPLETED" else 3


def cmd_serve(args) -> int:
    from pipeline.serve.runner import run

    settings = _settings(args)
    for name in ("host", "port", "reply_partitions", "shutdown_grace_s"):
        value = getattr(args, name)
        if value is not None:
            setattr(settings.serve, name, value)
    if args.access_log:
        settings.serve.access_log = True
    settings.validate()
    return run(settings)


def cmd_tenants(args) -> int:
    from pipeline.tenants.cli import cmd_tenants as run

    return run(_settings(args), args)


def cmd_cancel(args) -> int:
    from pipeline.client import LlmqClient

    with LlmqClient(_settings(args), listen=False) as client:
        client.cancel(args.request_id, args.reason)
    print(f"cancellation of {args.request_id} published")
    return 0


def cmd_batch(args) -> int:
    from pipeline.batch import cli as batch

    return {"submit": batch.submit, "status": batch.status, "cancel": batch.cancel,
            "results": batch.results}[args.action](args)


def cmd_demo(args) -> int:
    from pipeline.demo import run_demo

    return run_demo(_settings(args), requests=args.requests, workers=args.workers,
                    sim_latency_ms=args.sim_latency_ms, keep_broker=args.keep_broker, rate=args.rate,
                    gateway=not args.no_gateway, worker_metrics_port=args.worker_metrics_port)


def cmd_acls(args) -> int:
    from confluent_kafka.admin import AdminClient

    from pipeline import acls

    settings = _settings(args)
    if not args.apply:
        print(acls.describe(settings))
        return 0
    conf = settings.kafka.admin_config()
    if args.data_dir or args.port:
        # The local secured broker: act as its admin principal.
        broker = _broker(args, settings)
        conf = {**conf, "bootstrap.servers": broker.bootstrap, **broker.client_config("admin")}
    n = acls.apply(AdminClient(conf), settings)
    print(f"applied {n} ACL bindings for roles: {', '.join(acls.role_grants(settings))}")
    return 0


def cmd_lag(args) -> int:
    from pipeline.observability.lag_cli import cmd_lag as run

    return run(_settings(args), args.groups, args.json, args.watch, args.sample)


def cmd_lag_exporter(args) -> int:
    from pipeline.observability.lag_cli import cmd_lag_exporter as run

    return run(_settings(args), args.groups, args.interval, args.metrics_port, args.metrics_addr)


def dlq_filter(args):
    from pipeline.dlq_tools import Filter

    reasons = frozenset(r.strip() for given in (args.reason or []) for r in given.split(",") if r.strip())
    return Filter(reasons, args.since, args.until)


def _dlq_list(settings: Settings, args) -> int:
    from pipeline.dlq_tools import list_letters

    rows = list_letters(settings, dlq_filter(args))
    if args.json:
        for row in rows:
            _print_json(row)
        return 0
    print(f"{'RECORD':<{len(settings.topics.dlq) + 12}} {'SOURCE':<34} {'REASON':<20} {'FAILED AT':<24} "
          f"{'SIZE':>9}  REPLAYED TO")
    for r in rows:
        record = f"{r['dlq_topic']}:{r['partition']}:{r['offset']}"
        source = f"{r['source_topic'] or '-'}:{r['source_partition']}:{r['source_offset']}"
        size = f"{r['size']}" + (f" (of {r['truncated_from']})" if r["truncated_from"] else "")
        print(f"{record:<{len(settings.topics.dlq) + 12}} {source:<34} {r['reason']:<20} {r['failed_at']:<24} "
              f"{size:>9}  {r['replayed_to'] or '-'}")
    sys.stdout.flush()  # the count (on stderr) after the table, also when both go to one terminal
    print(f"{len(rows)} dead letter{'s' if len(rows) != 1 else ''}", file=sys.stderr)
    return 0


def _dlq_show(settings: Settings, args) -> int:
    from pipeline.dlq_tools import show_letter

    try:
        d = show_letter(settings, args.record, args.bytes)
    except ValueError as exc:
        print(f"llmq dlq show: {exc}", file=sys.stderr)
        return 2
    if d is None:
        print(f"llmq dlq show: no dead letter {args.record} in {settings.topics.dlq} (expired, never written, "
              "or in an aborted transaction)", file=sys.stderr)
        return 1
    if args.json:
        _print_json(d)
        return 0
    rows = [("record", f"{d['dlq_topic']}:{d['partition']}:{d['offset']}  (written {d['timestamp']})"),
            ("source", f"{d['source_topic'] or '-'}:{d['source_partition']}:{d['source_offset']}"),
            ("reason", d["reason"]), ("stage", d["stage"] or "-"), ("failed at", d["failed_at"]),
            ("error", d["error"] or "-"), ("key", d["key"] if d["key"] is not None else "(none)"),
            ("value", f"{d['size']} bytes" + (f", cut from {d['truncated_from']}" if d["truncated_from"] else "")),
            ("replay of", d["replay_of"] or "-"), ("replayed to", d["replayed_to"] or "not replayed")]
    for name, value in rows:
        print(f"{name + ':':<13}{value}")
    print("headers:")
    for k, v in d["headers"]:
        print(f"  {k} = {v}")
    print(f"value, first {min(args.bytes, d['size'])} bytes:")
    print(f"  {d['value_preview']}")
    for line in d["value_hex"]:
        print(f"  {line}")
    return 0


def _dlq_replay(settings: Settings, args) -> int:
    from pipeline.dlq_tools import replay
    from pipeline.progress import Progress

    bar: list[Progress] = []

    def on_progress(done: int, total: int) -> None:
        # A bar only for replays of more than one batch (or on a terminal).
        if not bar and (total > args.batch or sys.stderr.isatty()):
            bar.append(Progress(total, "replaying"))
        if bar:
            bar[0].advance(done - bar[0].done)

    try:
        report = replay(settings, dlq_filter(args), dry_run=args.dry_run, batch_size=args.batch,
                        on_progress=on_progress)
    finally:
        if bar:
            bar[0].close()
    if args.json:
        _print_json(report.to_dict())
        return 0
    if args.dry_run:
        for copy in report.replayed:
            print(f"{settings.topics.dlq}:{copy['record']} -> {copy['to']}")
    print(report.describe())
    return 0


def cmd_dlq(args) -> int:
    settings = _settings(args)
    return {"list": _dlq_list, "show": _dlq_show, "replay": _dlq_replay}[args.action](settings, args)


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(_LOG_LEVELS)}")
    return level


def _time(text: str) -> int:
    from pipeline.dlq_tools import parse_time

    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return n


def _global_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    # On a command's own parser the defaults are SUPPRESS: an option given there sets the value,
    # one left out keeps what the top-level parser read (``llmq --config x worker`` and
    # ``llmq worker --config x`` are the same).
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    g = parser.add_argument_group("global options (before or after the command)")
    g.add_argument("--config", default=d(None), metavar="FILE",
                   help="settings file (TOML; deploy/llmq.toml documents every key); default $LLMQ_CONFIG")
    g.add_argument("--bootstrap", default=d(None), metavar="HOST:PORT",
                   help="Kafka bootstrap servers; default $LLMQ_BOOTSTRAP or 127.0.0.1:9092")
    g.add_argument("--log-level", default=d("INFO"), type=_log_level, metavar="LEVEL",
                   help=f"{', '.join(_LOG_LEVELS)} (default INFO); librdkafka's own lines are logged as "
                        "pipeline.kafka, repeated connection failures summarised")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmq", description="llmq: a Kafka pipeline that queues and schedules LLM inference requests.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"llmq {version()}")
    _global_options(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str | None = None, parent=sub) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help, description=description or help)
        _global_options(p, suppress=True)
        return p

    p = command("broker", "run a local Apache Kafka (KRaft) from Maven jars: one broker, or a replicated cluster",
                "Manage the local development broker. `up` formats storage on first use, starts Kafka in the "
                "background and waits until it answers; it is idempotent. `status` exits 0 only when the broker "
                "answers. `down` stops it and leaves no process. `fetch` only downloads the jars (once, into "
                "~/.cache/llmq, counting them as Maven copies them). With --nodes 3, `up` runs a replicated "
                "cluster of three KRaft nodes (broker and controller each) on consecutive ports, and prints the "
                "environment its clients need (every node as bootstrap, replication factor 3); `status` and `down` "
                "find the cluster by its data dir.")
    p.add_argument("action", choices=["up", "status", "down", "fetch"])
    p.add_argument("--nodes", type=int, help="up: nodes of a local replicated cluster (default 1: one broker; "
                                             "topics then get RF = nodes and min.insync.replicas nodes - 1, at most 2)")
    p.add_argument("--port", type=int, help="client port (default 9092; a cluster's nodes take the next ones; "
                                            "controllers get free ports)")
    p.add_argument("--data-dir", help="storage, logs and pid file (default .llmq/kafka)")
    p.add_argument("--secure", action="store_true",
                   help="up: a SASL_SSL listener (SCRAM-SHA-512, a generated private CA) with the ACL authorizer; "
                        "one principal per role. Fixed when the data dir is first formatted.")
    p.add_argument("--json", action="store_true", help="status: one JSON document (state, pid, data dir, log file)")
    p.set_defaults(func=cmd_broker)

    p = command("topics", "create the pipeline's topics (idempotent, verifies partition counts)",
                "Creates the request, dispatch, response, dead-letter, cancellation, streamed-chunk, "
                "completion-receipt, batch-file, batch, stored-response and model-catalog topics with the "
                "partition counts and configs of the [topics] settings. Existing topics are left as they are; "
                "one whose partition count differs is reported as MISMATCH and the exit status is 2 (llmq never "
                "adds partitions: that would remap tenants' keys).")
    p.add_argument("action", choices=["create"])
    p.add_argument("--json", action="store_true", help="one JSON document: ok, created, existing, mismatched")
    p.set_defaults(func=cmd_topics)

    p = command("worker", "consume requests, call the model backend, publish responses",
                "An inference worker: a member of a consumer group over the request topics (with --source "
                "dispatch, the gateway's dispatch topics). It commits a "
                "partition's offset only past requests whose responses the broker has acknowledged. SIGTERM "
                "stops fetching, lets in-flight requests finish within worker.shutdown_grace_s, commits and "
                "leaves the group.")
    p.add_argument("--pool", help="realtime (CRITICAL+HIGH), async (NORMAL+LOW), background or all (default); "
                                  "a pool is its own consumer group, llmq-pool-<name>")
    p.add_argument("--delivery", choices=["at-least-once", "exactly-once"],
                   help="at-least-once (default) or exactly-once (transactions; read responses read_committed)")
    p.add_argument("--backend", choices=["simulated", "openai"], help="model backend (default simulated)")
    p.add_argument("--openai-base-url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 (vLLM); "
                                             "API key from LLMQ_WORKER__OPENAI_API_KEY(_FILE)")
    p.add_argument("--sim-latency-ms", type=float, help="simulated model: fixed latency per request")
    p.add_argument("--sim-ms-per-token", type=float, help="simulated model: extra latency per output token")
    p.add_argument("--max-inflight", type=int, help="requests in flight to the backend at once")
    p.add_argument("--group", dest="group_id", help="consumer group (default llmq-workers; with --pool, llmq-pool-<pool>)")
    p.add_argument("--worker-id", help="identity written into responses (default host-pid)")
    p.add_argument("--topics", help="comma-separated topics to consume (default: the pool's bands of the "
                                          "--source topics)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics, /healthz and /readyz on PORT "
                                                    "(default 9101; 0 = off)")
    p.add_argument("--metrics-addr", help="address to bind metrics to (default 127.0.0.1)")
    p.add_argument("--source", choices=["requests", "dispatch"],
                   help="dispatch: what the gateway admitted (llm.dispatch.<band>); requests (default): the "
                        "request topics directly, without a gateway")
    p.set_defaults(func=cmd_worker)

    p = command("gateway", "admit requests: priorities, rate limits, quotas, bounded queues",
                "The admission gateway (a Faust app): reads the five request topics and writes admitted requests "
                "to <prefix>.dispatch.<band>, rejections/expirations/cancellations to the response topic. Limits, "
                "quotas, tiers, queue caps and the downgrade map come from the [gateway] section of the config "
                "file (deploy/llmq.toml documents every key). Workers behind it run with --source dispatch. GET "
                "/v1/queue on the web port shows per-band depth, drain rate and ETA; /metrics serves Prometheus "
                "metrics. SIGTERM finishes the current batch, commits and leaves the group (a static member, "
                "--instance-id, stays in it until gateway.session_timeout_ms, 3 s by default).")
    p.add_argument("--web-port", type=int, help="port for /v1/queue, /metrics, /healthz and /readyz (default 6066; 0 = off)")
    p.add_argument("--app-id", help="Faust app id: consumer group and changelog topic prefix (default llmq-gateway)")
    p.add_argument("--instance-id", help="static group membership (e.g. the pod name): restarted under the same id, "
                                         "the gateway takes its partitions back at once instead of waiting for its "
                                         "old session to time out; unique per gateway")
    p.set_defaults(func=cmd_gateway)

    p = command("submit", "submit one request and print its response",
                "Publishes one request to the request topic of its priority (keyed by tenant) and, unless "
                "--no-wait, waits for its terminal response. With --via URL --key-file FILE it goes through "
                "`llmq serve` over HTTP instead (--no-wait: POST /v1/requests). Exit status 0 when it is "
                "COMPLETED, 3 otherwise.")
    p.add_argument("prompt")
    p.add_argument("--tenant", help="the tenant (required unless --via: then the API key names it)")
    p.add_argument("--priority", default="normal", help="critical, high, normal, low or background")
    p.add_argument("--model", default="", help="the model (default: the one the servers serve by default, "
                                               "models.default; `GET /v1/models` on serve lists them)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (also the request's timeout_ms)")
    p.add_argument("--no-wait", action="store_true", help="print the request id once acknowledged, don't wait")
    p.add_argument("--json", action="store_true", help="print the whole response as JSON")
    p.add_argument("--via", metavar="URL", help="through `llmq serve` at URL (e.g. http://127.0.0.1:8080) instead "
                                               "of Kafka; the tenant is the API key's")
    p.add_argument("--key-file", metavar="FILE", help="with --via: the file holding the API key")
    p.set_defaults(func=cmd_submit)

    p = command("serve", "an OpenAI-compatible HTTP server in front of the request topics",
                "Serves POST /v1/chat/completions and /v1/completions (answered when the answer comes, or "
                "\"stream\": true for Server-Sent Events), GET /v1/models, POST /v1/requests (202 and an id, for "
                "batch work; BACKGROUND by default) with GET /v1/requests/{id}, /healthz, /readyz and /metrics. "
                "Callers authenticate "
                "with Authorization: Bearer <key>; the key names the tenant (llmq tenants set --key-file), whose "
                "registry record sets its tier, the highest band it may ask for (x-llmq-priority or "
                "metadata.priority) and its models. Answers come back on this process's own reply partitions "
                "(serve.reply_partitions: give each process its own), read by one listener. Refusals keep "
                "OpenAI's error shape: 429 with Retry-After when rate-limited or the queue is full, 504 past the "
                "deadline (x-llmq-timeout-ms), 401/403 for keys. SIGTERM stops accepting, lets requests in flight "
                "finish for serve.shutdown_grace_s, answers the rest 503 and cancels them. [serve] in the config "
                "file holds every setting (pipeline/config/serve.py).")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8080; 0 = any free one, logged)")
    p.add_argument("--reply-partitions", help="partitions of the response and chunk topics this process owns: "
                                              "N, N,M or N-M (default auto: one at random)")
    p.add_argument("--shutdown-grace-s", type=float, help="on SIGTERM, how long requests in flight may finish")
    p.add_argument("--access-log", action="store_true", help="one log line per HTTP request (off by default)")
    p.set_defaults(func=cmd_serve)

    from pipeline.tenants.cli import add_parser as tenants_parser

    tenants_parser(command).set_defaults(func=cmd_tenants)

    p = command("acls", "print (or --apply) the least-privilege ACLs of every role",
                "One principal per role: producer, consumer, client, worker, gateway, lagexporter (see "
                "pipeline/acls.py). Without --apply, prints them. --apply creates them with the configured "
                "credentials, or as the admin of the local broker given by --port/--data-dir.")
    p.add_argument("--apply", action="store_true")
    p.add_argument("--port", type=int, help="local secured broker's port (use its admin credentials)")
    p.add_argument("--data-dir", help="local secured broker's data dir")
    p.set_defaults(func=cmd_acls)

    p = command("lag", "consumer lag per group/topic/partition, per-priority totals, time lag, ETA",
                "Like kafka-consumer-groups --describe for llmq's groups, plus per-priority queue depth, age of "
                "the oldest unconsumed request (exact, from message timestamps), drain rate (committed offsets "
                "per second between two samples) and ETA.")
    p.add_argument("--groups", default=r"^llmq-", help="regex of consumer groups to show (default ^llmq-)")
    p.add_argument("--json", action="store_true", help="one JSON document per sample")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until interrupted")
    p.add_argument("--sample", type=float, default=2.0, help="seconds between the two samples behind drain/ETA")
    p.set_defaults(func=cmd_lag)

    p = command("lag-exporter", "export consumer lag under kafka_exporter's metric names",
                "Serves kafka_exporter's series (kafka_brokers, kafka_topic_partitions, "
                "kafka_topic_partition_current_offset/oldest_offset, kafka_consumergroup_current_offset(_sum), "
                "kafka_consumergroup_lag(_sum), kafka_consumergroup_members: Grafana dashboard 7589 and Strimzi "
                "rules work) plus llmq_queue_depth, llmq_oldest_request_age_seconds and "
                "llmq_consumergroup_lag_seconds. Lag is never negative; a partition never committed is counted "
                "in llmq_consumergroup_uncommitted_partitions. Reads the admin API once per --interval, whatever "
                "the scrape rate.")
    p.add_argument("--groups", default=r"^llmq-", help="regex of consumer groups to export (default ^llmq-)")
    p.add_argument("--interval", type=float, default=15.0, help="seconds between admin API reads (default 15)")
    p.add_argument("--metrics-port", type=int, default=9102,
                   help="serve /metrics, /healthz and /readyz on PORT (default 9102)")
    p.add_argument("--metrics-addr", default="127.0.0.1",
                   help="address to bind to (default 127.0.0.1; 0.0.0.0 in a container)")
    p.set_defaults(func=cmd_lag_exporter)

    _dlq_parser(command)
    _batch_parser(command)

    p = command("cancel", "cancel a request (answered CANCELLED unless already finished)",
                "Publishes a cancellation for the request id: a request not yet started is answered CANCELLED "
                "by whoever takes it next (gateway or worker); one already answered is left as it is.")
    p.add_argument("request_id")
    p.add_argument("--reason", default="cancelled by the client")
    p.set_defaults(func=cmd_cancel)

    p = command("demo", "the end-to-end demo behind `make demo`",
                "Starts the local broker if none answers, creates topics, starts the gateway and workers, "
                "submits a load mostly of BACKGROUND work (more than the workers can take) across priorities "
                "and tenants, one of them rate-limited, some requests degradable; prints per-priority waits and "
                "latencies, the rate-limited and degraded requests, then stops what it started.")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sim-latency-ms", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=350.0,
                   help="requests per second submitted (default 350: under what the gateway admits here, "
                        "over what the demo's workers serve)")
    p.add_argument("--no-gateway", action="store_true", help="workers read the request topics directly")
    p.add_argument("--keep-broker", action="store_true", help="leave a broker the demo started running")
    p.add_argument("--worker-metrics-port", type=int, default=0, metavar="PORT",
                   help="serve worker i's Prometheus metrics on PORT + i (default 0: none; the gateway's are on "
                        "its web port, 6066)")
    p.set_defaults(func=cmd_demo)
    return parser


def _dlq_parser(command) -> None:
    p = command("dlq", "list, show and replay dead letters (messages llmq could not read)",
                "The dead-letter topic (<prefix>.dlq) holds the original bytes of every message llmq could not "
                "read, with why in llmq.dlq.* headers. `list` and `replay` take the same filters. `replay` "
                "publishes each one again to the topic it came from, marked llmq.replayed-from, e.g. once a "
                "schema revision its writer used is published; a dead letter is replayed at most once, even "
                "across interrupted runs (a replay mark is committed in the same transaction as its copy).")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    def filters(q: argparse.ArgumentParser) -> None:
        q.add_argument("--reason", action="append", metavar="REASON",
                       help="only this reason (unknown_fingerprint, malformed, ...); repeat or comma-separate "
                            "for several")
        q.add_argument("--since", type=_time, metavar="TIME",
                       help="failed at or after TIME: 30m, 2h, 7d (ago), 2026-01-31, 2026-01-31T14:00 (UTC) or "
                            "with its zone, or epoch ms")
        q.add_argument("--until", type=_time, metavar="TIME", help="failed at or before TIME (same forms)")

    q = command("list", "one line per dead letter: record, source, reason, time, size, where it was replayed",
                "One line per dead letter, oldest first per partition: the record (topic:partition:offset, what "
                "`show` takes), the message it was (source topic:partition:offset), the reason, when it failed "
                "(UTC), its size in bytes, and where its copy went if it was replayed.", parent=actions)
    filters(q)
    q.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")

    q = command("show", "one dead letter: headers, error, a printable and hex preview of its value",
                "One dead letter in full: its headers (control characters escaped), the error (without server "
                "paths), key, and the first --bytes bytes of the value as text and as hex.", parent=actions)
    q.add_argument("record", help="PARTITION:OFFSET, OFFSET (partition 0) or TOPIC:PARTITION:OFFSET as `list` shows")
    q.add_argument("--bytes", type=_positive, default=256, help="how much of the value to preview (default 256)")
    q.add_argument("--json", action="store_true", help="one JSON document")

    q = command("replay", "publish dead letters again to the topic they came from, each at most once",
                "Publishes each matching dead letter that was never replayed to its source topic (only llmq's "
                "request and dispatch topics), key, value and headers as they were, plus "
                "llmq.replayed-from: <dlq topic>:<partition>:<offset>. Copies and their replay marks commit "
                "together, a batch per transaction; a run stopped half-way is resumed by running it again. One "
                "replay of a topic at a time: a new run stops one still running. Dead letters cut to the size "
                "limit are never replayed.", parent=actions)
    filters(q)
    q.add_argument("--dry-run", action="store_true", help="print what would be replayed; publish nothing")
    q.add_argument("--batch", type=_positive, default=100, help="dead letters per transaction (default 100)")
    q.add_argument("--json", action="store_true", help="the report as one JSON document")
    p.set_defaults(func=cmd_dlq)


def _batch_parser(command) -> None:
    from pipeline.batch import cli as batch
    from pipeline.batch.record import ENDPOINTS

    p = command("batch", "OpenAI batch jobs through `llmq serve`: submit a JSONL file, follow it, fetch its results",
                "OpenAI's Batch API on `llmq serve`, over HTTP (Kafka is serve's business). `submit` uploads a "
                "JSONL file, one request a line ({\"custom_id\", \"method\": \"POST\", \"url\", \"body\"}), and "
                "creates a batch on it; `status`, `cancel` and `results` act on a batch by its id. Every action "
                f"talks to --via URL (default ${batch.URL_ENV} or {batch.DEFAULT_URL}) with the API key in "
                f"--key-file FILE (default ${batch.KEY_FILE_ENV}); the key names the tenant and is never printed. "
                "Exit status: 0 done, 1 serve unreachable, 2 usage error, 3 serve refused (its HTTP status and "
                "OpenAI error message are printed) or the batch did not end as asked, 130 interrupted while "
                "waiting (the batch keeps running).")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    def serve_options(q: argparse.ArgumentParser) -> None:
        q.add_argument("--via", metavar="URL", help=f"llmq serve's base URL (default ${batch.URL_ENV} or "
                                                    f"{batch.DEFAULT_URL})")
        q.add_argument("--key-file", metavar="FILE", help=f"the file holding the API key (default "
                                                          f"${batch.KEY_FILE_ENV})")

    def json_option(q: argparse.ArgumentParser) -> None:
        q.add_argument("--json", action="store_true", help="print OpenAI's batch object as JSON (the final one "
                                                           "when waiting)")

    q = command("submit", "upload a JSONL file and start a batch on it; --wait follows it to its end",
                "Uploads FILE (POST /v1/files, purpose batch), creates a batch on it (POST /v1/batches) and prints "
                "its id. Its lines run in the LOW or BACKGROUND band (--priority, within what the tenant may ask "
                "for; serve's batch.default_priority otherwise), behind interactive work, until each is answered "
                "or the window closes. --wait shows how many lines are answered, polling every second, until the "
                "batch ends; then saves --output and --errors, prints a one-line summary and exits 0 if it "
                "completed, 3 if it failed, expired or was cancelled. Ctrl-C stops the waiting, not the batch.",
                parent=actions)
    q.add_argument("file", metavar="FILE", help="the requests, one JSON object a line")
    serve_options(q)
    json_option(q)
    q.add_argument("--endpoint", choices=ENDPOINTS, default=ENDPOINTS[0],
                   help="the endpoint every line's url names (default %(default)s)")
    q.add_argument("--window", type=batch.window, default="24h", metavar="DURATION",
                   help="completion window: lines not answered by then end expired, e.g. 1h (default %(default)s)")
    q.add_argument("--metadata", type=batch.key_value, action="extend", nargs="+", metavar="KEY=VALUE",
                   help="the batch's metadata (up to 16 pairs)")
    q.add_argument("--priority", type=str.lower, choices=["low", "background"],
                   help="the band of its lines (sent as metadata.priority)")
    q.add_argument("--wait", action="store_true", help="follow the batch to its end (exit status: how it ended)")
    q.add_argument("--output", metavar="OUT.jsonl", help="with --wait: save the answered lines here")
    q.add_argument("--errors", metavar="ERR.jsonl", help="with --wait: save the lines that failed here")

    q = command("status", "a batch's status, request counts, file ids and timestamps",
                "Shows a batch (GET /v1/batches/{id}): its status (validating, in_progress, finalizing, "
                "completed, failed, expired, cancelling, cancelled), how many lines completed and failed of the "
                "total, its input, output and error file ids, metadata, and when each step happened (UTC).",
                parent=actions)
    q.add_argument("batch_id", metavar="BATCH_ID")
    serve_options(q)
    json_option(q)

    q = command("cancel", "cancel a batch: lines not started end cancelled, answered ones are kept",
                "Asks serve to cancel the batch (POST /v1/batches/{id}/cancel): it shows as cancelling while "
                "lines already started finish, then ends cancelled with result files for what was answered. "
                "--wait follows it to its end and exits 0 if it ended cancelled, 3 if it ended otherwise first.",
                parent=actions)
    q.add_argument("batch_id", metavar="BATCH_ID")
    serve_options(q)
    json_option(q)
    q.add_argument("--wait", action="store_true", help="follow the batch until it has ended")

    q = command("results", "download an ended batch's output (and error) file",
                "Downloads the output file of a batch that has ended (completed, expired or cancelled ones keep "
                "what was answered) to --output, or prints it to stdout, and its error file to --errors. A "
                "result file the batch does not have is saved empty. Exit status 3 while the batch is still "
                "running.", parent=actions)
    q.add_argument("batch_id", metavar="BATCH_ID")
    serve_options(q)
    q.add_argument("--output", metavar="OUT.jsonl", help="save the output file here instead of printing it")
    q.add_argument("--errors", metavar="ERR.jsonl", help="save the error file here")
    p.set_defaults(func=cmd_batch)


def _setup_logging(level: str) -> None:
    from pipeline import kafka_log

    logging.basicConfig(level=getattr(logging, level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    kafka_log.install()


def main(argv: list[str] | None = None) -> int:
    from pipeline import kafka_log

    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        return args.func(args)
    except LlmqError as exc:
        print(f"llmq {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        kafka_log.flush()


if __name__ == "__main__":
    sys.exit(main())
