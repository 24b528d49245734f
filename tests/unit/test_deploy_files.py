"""The files for users with Docker stay consistent with what the code runs locally."""

from pathlib import Path

import yaml

from pipeline.broker import LocalBroker
from pipeline.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_docker_compose_runs_the_same_kafka_version_and_single_node_settings(tmp_path):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    kafka = compose["services"]["kafka"]
    assert kafka["image"] == f"apache/kafka:{Settings().broker.kafka_version}"
    env = kafka["environment"]
    broker = LocalBroker(9092, tmp_path)
    broker.write_config(9093)
    local = dict(line.split("=", 1) for line in (tmp_path / "server.properties").read_text().splitlines())
    for key in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor",
                "transaction.state.log.min.isr", "group.initial.rebalance.delay.ms", "auto.create.topics.enable"):
        compose_key = "KAFKA_" + key.upper().replace(".", "_")
        assert str(env[compose_key]).lower() == local[key].lower(), key
    # Host clients find it where LLMQ_BOOTSTRAP points by default.
    assert "127.0.0.1:9092:9092" in kafka["ports"]
    assert Settings().kafka.bootstrap == "127.0.0.1:9092"


def test_compose_services_use_the_llmq_commands_that_exist():
    from pipeline.cli import build_parser

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    parser = build_parser()
    for name in ("topics", "gateway-1", "gateway-2", "worker", "lag-exporter"):
        command = compose["services"][name]["command"]
        assert command[0] == "llmq"
        parser.parse_args(command[1:])


def test_shipped_workers_read_what_the_gateway_admitted():
    """Compose and Kubernetes run gateways: their workers and KEDA triggers must use the dispatch topics."""
    from pipeline.cli import build_parser

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"gateway-1", "gateway-2", "worker", "lag-exporter", "prometheus", "grafana"} <= set(services)
    args = build_parser().parse_args(services["worker"]["command"][1:])
    assert args.source == "dispatch"

    k8s = ROOT / "deploy" / "k8s"
    workers = [d for d in yaml.safe_load_all((k8s / "workers.yaml").read_text()) if d and d["kind"] == "Deployment"]
    assert workers
    for deployment in workers:
        env = {e["name"]: e.get("value") for c in deployment["spec"]["template"]["spec"]["containers"]
               for e in c.get("env", [])}
        assert env.get("LLMQ_WORKER__SOURCE") == "dispatch", deployment["metadata"]["name"]
    triggers = [t["metadata"]["topic"] for d in yaml.safe_load_all((k8s / "keda-scaledobjects.yaml").read_text())
                if d for t in d["spec"]["triggers"]]
    assert triggers and all(t.startswith("llm.dispatch.") for t in triggers), triggers


def test_the_k8s_gateway_is_a_static_member_named_after_its_pod():
    from pipeline.cli import build_parser

    docs = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "gateway.yaml").read_text())}
    sts, service = docs["StatefulSet"], docs["Service"]
    pod = sts["spec"]["template"]
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    # A pod's name survives its restarts in a StatefulSet: as the instance id it makes the
    # restarted gateway the same group member, which takes its partitions back at once.
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    command = container["command"]
    assert command[0] == "llmq"
    args = build_parser().parse_args(command[1:])
    assert args.func.__name__ == "cmd_gateway" and args.instance_id == "$(POD_NAME)"
    settings = Settings.load(env={k: e["value"] for k, e in env.items() if k.startswith("LLMQ_")})
    settings.validate()
    assert settings.gateway.session_timeout_ms == int(env["LLMQ_GATEWAY__SESSION_TIMEOUT_MS"]["value"])
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["web"]
    assert port == settings.gateway.web_port and settings.gateway.web_host == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v1/queue"
    # More gateways than request partitions per band would get none to admit from.
    assert sts["spec"]["replicas"] <= settings.topics.request_partitions
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert sts["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
