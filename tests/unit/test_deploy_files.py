"""The files users deploy with stay consistent with what the code accepts.

docker-compose.yml (and docker-compose.no-gateway.yml over it), the Dockerfile and deploy/k8s are never run
here (no Docker, no cluster), so they are checked against the code statically, container by container:

* the command and its flags parse with llmq's own argument parser (``pipeline.cli.build_parser``; the
  model simulator's with its own), as the process would parse them;
* every ``LLMQ_*`` variable is one llmq reads: ``LLMQ_<SECTION>__<KEY>`` goes through ``Settings.load`` with
  the container's whole environment and the config file it names (the ConfigMap made from
  deploy/llmq.toml), the flags are applied on top as the command applies them, and the result validates;
  other ``LLMQ_*`` names must be read somewhere in pipeline/;
* the port the process then serves on (web, metrics or HTTP port, from the settings and flags) is the one
  its container declares, its health checks and probes ask, its scrape annotation names and its Services
  target, bound to 0.0.0.0 so that anything outside the container reaches it;
* long-running llmq processes have a restart policy and a health check on /healthz (Kubernetes: liveness
  on /healthz, readiness on /readyz).

``deploy_problems`` returns what is wrong; the tests below run it on the shipped files (nothing may be
wrong) and on copies changed in memory (a renamed flag, variable or port must be found).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.broker import LocalBroker
from pipeline.config import Settings
from pipeline.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
NO_GATEWAY = ROOT / "docker-compose.no-gateway.yml"
DOCKERFILE = ROOT / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
EXAMPLE_CONFIG = ROOT / "deploy" / "llmq.toml"
#: The ConfigMap that deploy/k8s/README.md makes from deploy/llmq.toml, and the key its file is under.
CONFIG_MAP, CONFIG_KEY = "llmq-config", "llmq.toml"
LLMQ_IMAGE = "llmq:dev"
HEALTH_PATHS = {"/healthz", "/readyz"}
ANY_ADDRESS = {"0.0.0.0", "::"}
WORKLOADS = ("Deployment", "StatefulSet", "Job", "DaemonSet")


@dataclass
class Container:
    """What one container of a deploy file runs, as the checks need it."""

    where: str
    argv: list[str]
    env: dict[str, str]
    #: Ports it declares: compose's published container ports, Kubernetes' containerPorts (name → port).
    ports: dict[str, int] = field(default_factory=dict)
    #: (path, port) of each health check or probe, with its kind (healthcheck, livenessProbe, ...).
    probes: list[tuple[str, str, int]] = field(default_factory=list)
    scrape_port: int | None = None
    #: mountPath → the ConfigMap mounted there.
    config_maps: dict[str, str] = field(default_factory=dict)
    restart: str | None = None
    long_running: bool = True


# -- reading the files -----------------------------------------------------------------------------

_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: Any) -> str:
    """Compose's ${VAR:-default}, with VAR unset (what a plain `docker compose up` sees)."""
    return _INTERPOLATION.sub(lambda m: m.group(2) or "", str(value))


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of an override file: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base[key], value) if key in base else value
        return out
    return override


def _compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: interpolate(v) for k, v in env.items()}


def _compose_port(spec: Any) -> int:
    """The container side of "127.0.0.1:9111-9112:9101", "8080:8080/tcp" or {target: 8080}."""
    if isinstance(spec, dict):
        return int(spec["target"])
    return int(str(spec).split("/")[0].rsplit(":", 1)[-1])


def _healthcheck_urls(test: Any) -> list[tuple[str, int]]:
    text = " ".join(test) if isinstance(test, list) else str(test)
    return [(m.group(2) or "/", int(m.group(1)))
            for m in re.finditer(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/[\w/.-]*)?", text)]


def compose_containers(compose: dict) -> list[Container]:
    """The llmq image's services that `docker compose up` starts (services behind a profile left out)."""
    out = []
    for name, service in compose["services"].items():
        if service.get("image") != LLMQ_IMAGE or service.get("profiles"):
            continue
        command = service.get("command")
        argv = shlex.split(command) if isinstance(command, str) else [interpolate(a) for a in command]
        health = service.get("healthcheck", {})
        probes = [("healthcheck", path, port) for path, port in _healthcheck_urls(health.get("test", ""))]
        ports = {str(i): _compose_port(p) for i, p in enumerate(service.get("ports", []))}
        out.append(Container(f"docker-compose: {name}", argv, _compose_env(service), ports, probes,
                             restart=service.get("restart"), long_running=argv[1:2] != ["topics"]))
    return out


def k8s_docs(directory: Path = K8S) -> dict[str, list[dict]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(directory.glob("*.yaml"))}


_PLACEHOLDERS = {"metadata.name": "llmq-pod-0", "metadata.namespace": "llmq", "status.podIP": "10.0.0.7"}


def _k8s_env(container: dict) -> dict[str, str]:
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        else:  # what the kubelet would fill in
            ref = e["valueFrom"].get("fieldRef", {}).get("fieldPath")
            env[e["name"]] = _PLACEHOLDERS.get(ref, "from-a-secret")
    return env


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes expands $(VAR) in command and args from the container's environment."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def k8s_containers(docs: dict[str, list[dict]]) -> list[Container]:
    out = []
    for file, documents in docs.items():
        for doc in documents:
            if doc["kind"] not in WORKLOADS:
                continue
            template = doc["spec"]["template"]
            pod = template["spec"]
            volumes = {v["name"]: v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v}
            for c in pod["containers"]:
                if c["image"] != LLMQ_IMAGE:
                    continue
                env = _k8s_env(c)
                argv = [_expand(a, env) for a in c.get("command", []) + c.get("args", [])]
                ports = {p.get("name", str(p["containerPort"])): p["containerPort"] for p in c.get("ports", [])}
                probes = []
                for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
                    get = c.get(kind, {}).get("httpGet")
                    if get:
                        port = get["port"]
                        probes.append((kind, get["path"], ports.get(port, -1) if isinstance(port, str) else port))
                annotations = template["metadata"].get("annotations", {})
                scrape = annotations.get("prometheus.io/port") if annotations.get("prometheus.io/scrape") == "true" \
                    else None
                mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", []) if m["name"] in volumes}
                out.append(Container(f"deploy/k8s/{file}: {doc['kind']}/{doc['metadata']['name']}: {c['name']}",
                                     argv, env, ports, probes, int(scrape) if scrape else None, mounts,
                                     long_running=doc["kind"] != "Job"))
    return out


def dockerfile_env(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for pair in shlex.split(line[4:]):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


# -- checking them ---------------------------------------------------------------------------------


def _parse(parse, argv: list[str]):
    """argparse's namespace, or its error message (it exits on errors)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parse(argv), None
        except SystemExit:
            return None, err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "exits"


@functools.cache
def _help_text(command: str) -> str:
    from pipeline.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        build_parser().parse_args([command, "--help"])
    return out.getvalue()


@dataclass
class Served:
    """Where a process listens once its settings and flags are applied, and how it is checked."""

    host: str
    port: int
    paths: set[str]


@functools.cache
def _non_settings_variables() -> frozenset[str]:
    """LLMQ_* names the code reads other than LLMQ_<SECTION>__<KEY>: those it quotes somewhere."""
    names = set()
    for path in (ROOT / "pipeline").rglob("*.py"):
        names.update(re.findall(r"""["'](LLMQ_[A-Z0-9_]+)["']""", path.read_text()))
    return frozenset(n for n in names if "__" not in n and not n.endswith("_"))


def env_problems(where: str, env: dict[str, str], config: Path | None = None) -> tuple[list[str], Settings | None]:
    problems = []
    known = _non_settings_variables()
    for name in env:
        if name.startswith("LLMQ_") and "__" not in name and not name.startswith("LLMQ_RDKAFKA_") \
                and name not in known:
            problems.append(f"{where}: {name} is read by nothing in llmq")
    llmq_env = {k: v for k, v in env.items() if k.startswith("LLMQ_") and k != "LLMQ_CONFIG"}
    try:
        return problems, Settings.load(config, env=llmq_env)
    except ConfigError as exc:
        return problems + [f"{where}: {exc}"], None


def _config_file(c: Container) -> tuple[Path | None, list[str]]:
    """The file LLMQ_CONFIG names in the container: deploy/llmq.toml, when it is the ConfigMap made from it."""
    path = c.env.get("LLMQ_CONFIG")
    if path is None:
        return None, []
    directory, _, key = path.rpartition("/")
    if c.config_maps.get(directory) == CONFIG_MAP and key == CONFIG_KEY:
        return EXAMPLE_CONFIG, []
    return None, [f"{c.where}: LLMQ_CONFIG={path} is not the {CONFIG_KEY} of the ConfigMap {CONFIG_MAP} "
                  f"mounted in the container"]


def _apply_flags(section: Any, args, renames: dict[str, str] | None = None) -> None:
    """The flags that set a setting of the command's section, applied as the command applies them."""
    renames = renames or {}
    for dest, value in vars(args).items():
        name = renames.get(dest, dest)
        if value is not None and not callable(value) and hasattr(section, name):
            setattr(section, name, value)


def _served(argv: list[str], settings: Settings) -> tuple[Served | None, str | None]:
    from pipeline.cli import build_parser

    if argv[:3] == ["python", "-m", "pipeline.simulator"]:
        from pipeline.simulator.__main__ import parse_args

        args, error = _parse(parse_args, argv[3:])
        return (Served(args.host, args.port, {"/health"}) if args else None), error
    if argv[:1] != ["llmq"]:
        return None, f"runs {argv[:1]}, not llmq"
    args, error = _parse(build_parser().parse_args, argv[1:])
    if args is None:
        return None, error
    command = args.command
    # argparse also takes a prefix of a flag (--instance for --instance-id), which would hide a rename
    # that kept the old name as a prefix: each flag must be spelt as the command's --help spells it.
    help_text = _help_text(argv[1])
    for flag in (a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")):
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text):
            return None, f"{flag} is not a flag of `llmq {command}` (its --help)"
    if command == "worker":
        _apply_flags(settings.worker, args, {"group_id": "group_id"})
        w = settings.worker
        served = Served(w.metrics_addr, w.metrics_port, HEALTH_PATHS)
    elif command == "gateway":
        _apply_flags(settings.gateway, args)
        served = Served(settings.gateway.web_host, settings.gateway.web_port, HEALTH_PATHS)
    elif command == "serve":
        _apply_flags(settings.serve, args)
        served = Served(settings.serve.host, settings.serve.port, HEALTH_PATHS)
    elif command == "lag-exporter":
        served = Served(args.metrics_addr, args.metrics_port, HEALTH_PATHS)
    else:
        served = None
    try:
        settings.validate()
    except ConfigError as exc:
        return None, str(exc)
    return served, None


def effective_settings(c: Container) -> Settings:
    """The container's settings as its process sees them: config file, environment, then its flags."""
    config, _ = _config_file(c)
    _, settings = env_problems(c.where, c.env, config)
    _served(c.argv, settings)
    return settings


def container_problems(c: Container) -> list[str]:
    config, problems = _config_file(c)
    env_found, settings = env_problems(c.where, c.env, config)
    problems += env_found
    if settings is None:
        return problems
    served, error = _served(c.argv, settings)
    if error:
        return problems + [f"{c.where}: {shlex.join(c.argv)}: {error}"]
    if c.long_running and c.argv[:1] == ["llmq"] and c.restart is None and c.where.startswith("docker-compose"):
        problems.append(f"{c.where}: no restart policy (the process exits on purpose and expects a supervisor)")
    if served is None:
        return problems
    if served.host not in ANY_ADDRESS:
        problems.append(f"{c.where}: listens on {served.host}, unreachable from outside the container")
    if c.ports and served.port not in c.ports.values():
        problems.append(f"{c.where}: serves on {served.port}, declares {sorted(c.ports.values())}")
    for kind, path, port in c.probes:
        if port != served.port:
            problems.append(f"{c.where}: {kind} asks port {port}, the process serves on {served.port}")
        if path not in served.paths:
            problems.append(f"{c.where}: {kind} asks {path}, not one of {sorted(served.paths)}")
    if c.scrape_port is not None and c.scrape_port != served.port:
        problems.append(f"{c.where}: scraped on {c.scrape_port}, serves metrics on {served.port}")
    if c.long_running and served.paths == HEALTH_PATHS:
        kinds = {(kind, path) for kind, path, _ in c.probes}
        wanted = ({("healthcheck", "/healthz")} if c.where.startswith("docker-compose")
                  else {("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")})
        for kind, path in sorted(wanted - kinds):
            problems.append(f"{c.where}: no {kind} on {path}")
    return problems


def service_problems(docs: dict[str, list[dict]]) -> list[str]:
    """Every Kubernetes Service selects pods that declare the port it targets."""
    pods = [(d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"]["containers"])
            for documents in docs.values() for d in documents if d["kind"] in WORKLOADS]
    problems = []
    for file, documents in docs.items():
        for svc in (d for d in documents if d["kind"] == "Service"):
            selected = [cs for labels, cs in pods if svc["spec"]["selector"].items() <= labels.items()]
            if not selected:
                problems.append(f"deploy/k8s/{file}: Service/{svc['metadata']['name']} selects no pod")
            for port in svc["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                for containers in selected:
                    declared = {p.get("name") for c in containers for p in c.get("ports", [])} | {
                        p["containerPort"] for c in containers for p in c.get("ports", [])}
                    if target not in declared:
                        problems.append(f"deploy/k8s/{file}: Service/{svc['metadata']['name']} targets {target}, "
                                        f"which its pods do not declare")
    return problems


def deploy_problems(compose: dict, docs: dict[str, list[dict]], dockerfile: str) -> list[str]:
    problems = []
    for c in compose_containers(compose) + k8s_containers(docs):
        problems += container_problems(c)
    problems += service_problems(docs)
    problems += env_problems("Dockerfile", dockerfile_env(dockerfile))[0]
    return problems


def _shipped() -> tuple[dict, dict[str, list[dict]], str]:
    return yaml.safe_load(COMPOSE.read_text()), k8s_docs(), DOCKERFILE.read_text()


# -- the shipped files -----------------------------------------------------------------------------


def test_compose_the_dockerfile_and_the_manifests_use_only_what_llmq_accepts():
    compose, docs, dockerfile = _shipped()
    assert deploy_problems(compose, docs, dockerfile) == []
    # The checks saw every llmq process (not a silently empty list).
    commands = {c.argv[1] for c in compose_containers(compose) + k8s_containers(docs) if c.argv[0] == "llmq"}
    assert commands == {"topics", "gateway", "worker", "serve", "lag-exporter"}


def test_the_variant_without_a_gateway_works():
    compose = merge(yaml.safe_load(COMPOSE.read_text()), yaml.safe_load(NO_GATEWAY.read_text()))
    assert deploy_problems(compose, {}, "") == []
    running = {name for name, s in compose["services"].items() if not s.get("profiles")}
    assert not {"gateway-1", "gateway-2"} & running
    (worker,) = [c for c in compose_containers(compose) if c.where.endswith(": worker")]
    assert effective_settings(worker).worker.source == "requests"
    # Nothing left running needs what the variant removed.
    for name in running:
        depends = compose["services"][name].get("depends_on") or {}
        for dependency, condition in (dict.fromkeys(depends, {}) if isinstance(depends, list) else depends).items():
            required = not isinstance(condition, dict) or condition.get("required", True)
            assert dependency in running or not required, f"{name} needs {dependency}"


def test_compose_production_shape():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"kafka", "topics", "model", "vllm", "gateway-1", "gateway-2", "worker", "serve", "lag-exporter",
            "prometheus", "grafana"} <= set(services)
    assert services["vllm"]["profiles"] == ["vllm"] and services["vllm"]["image"].startswith("vllm/vllm-openai:")
    assert "VLLM_MODEL" in str(services["vllm"]["command"])
    # The queue outlives `docker compose down`.
    data_dir = services["kafka"]["environment"]["KAFKA_LOG_DIRS"]
    volume, _, path = services["kafka"]["volumes"][0].partition(":")
    assert path == data_dir and volume in compose["volumes"]
    for c in compose_containers(compose):
        assert c.ports or not c.long_running, f"{c.where}: nothing published"
    # The workers call the model server over HTTP, the simulator unless MODEL_URL says otherwise.
    (worker,) = [c for c in compose_containers(compose) if c.where.endswith(": worker")]
    settings = effective_settings(worker)
    assert settings.worker.backend == "openai" and settings.worker.source == "dispatch"
    model = services["model"]
    model_port = _compose_port(model["ports"][0])
    assert settings.worker.openai_base_url == f"http://model:{model_port}/v1"
    # The simulator answers the simulated models the gateway's degradation maps between.
    from pipeline.simulator.__main__ import parse_args

    names = set(parse_args(model["command"][3:]).served_model_name)
    simulated = {m for pair in Settings().gateway.downgrade.items() for m in pair if m.startswith("sim-")}
    assert simulated and simulated <= names


def test_docker_compose_runs_the_same_kafka_version_and_single_node_settings(tmp_path):
    compose = yaml.safe_load(COMPOSE.read_text())
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
    # The gateways' sessions fit the broker's bounds.
    assert int(env["KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS"]) <= Settings().gateway.session_timeout_ms


def test_shipped_workers_read_what_the_gateway_admitted():
    """Compose and Kubernetes run gateways: their workers and KEDA triggers must use the dispatch topics."""
    compose, docs, _ = _shipped()
    workers = [c for c in compose_containers(compose) + k8s_containers(docs) if c.argv[1:2] == ["worker"]]
    assert len(workers) == 5  # compose, three pools, the exactly-once StatefulSet
    for c in workers:
        settings = effective_settings(c)
        assert settings.worker.source == "dispatch", c.where
        assert settings.worker.backend == "openai", c.where
    triggers = [t["metadata"]["topic"] for d in docs["keda-scaledobjects.yaml"] for t in d["spec"]["triggers"]]
    assert triggers and all(t.startswith("llm.dispatch.") for t in triggers), triggers


def test_k8s_workers_have_routes_and_their_api_key_from_a_secret():
    docs = k8s_docs()
    secrets = {d["metadata"]["name"] for documents in docs.values() for d in documents if d["kind"] == "Secret"}
    for file in ("workers.yaml", "workers-exactly-once.yaml"):
        for doc in (d for d in docs[file] if d["kind"] in WORKLOADS):
            pod = doc["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            env = _k8s_env(c)
            assert "LLMQ_WORKER__OPENAI_API_KEY" not in env, "the key belongs in a file from a Secret"
            key_file = env["LLMQ_WORKER__OPENAI_API_KEY_FILE"]
            secret_volumes = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"] if m["name"] in secret_volumes}
            directory = key_file.rpartition("/")[0]
            assert directory in mounts and secret_volumes[mounts[directory]] in secrets, doc["metadata"]["name"]
            config, _ = _config_file(Container("", [], env, config_maps={
                m["mountPath"]: v["configMap"]["name"] for m in c["volumeMounts"] for v in pod["volumes"]
                if v["name"] == m["name"] and "configMap" in v}))
            settings = Settings.load(config, env={k: v for k, v in env.items() if k != "LLMQ_CONFIG"})
            assert settings.worker.openai_routes and "*" in settings.worker.openai_routes


def test_k8s_exactly_once_workers_are_static_members_named_after_their_pods():
    docs = k8s_docs()
    (sts,) = [d for d in docs["workers-exactly-once.yaml"] if d["kind"] == "StatefulSet"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    worker_id = {e["name"]: e for e in c["env"]}["LLMQ_WORKER__WORKER_ID"]
    assert worker_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    (container,) = k8s_containers({"w.yaml": [sts]})
    settings = effective_settings(container)
    assert settings.worker.delivery == "exactly-once" and settings.worker.static_membership
    # The gateway measures drain from this group without being told.
    assert settings.worker.effective_group_id() in settings.worker.group_ids()
    assert sts["spec"]["replicas"] <= settings.topics.dispatch_partitions
    # Never KEDA-scaled: a static member removed for good holds its partitions until its session ends.
    targets = {d["spec"]["scaleTargetRef"]["name"] for d in docs["keda-scaledobjects.yaml"]}
    assert sts["metadata"]["name"] not in targets


def test_the_k8s_gateway_is_a_static_member_named_after_its_pod():
    from pipeline.cli import build_parser

    docs = {d["kind"]: d for d in k8s_docs()["gateway.yaml"]}
    sts, service = docs["StatefulSet"], docs["Service"]
    pod = sts["spec"]["template"]
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    # A pod's name survives its restarts in a StatefulSet: as the instance id it makes the
    # restarted gateway the same group member, which takes its partitions back at once.
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    args = build_parser().parse_args(container["command"][1:])
    assert args.func.__name__ == "cmd_gateway" and args.instance_id == "$(POD_NAME)"
    settings = Settings.load(EXAMPLE_CONFIG, env={k: e["value"] for k, e in env.items()
                                                  if k.startswith("LLMQ_") and k != "LLMQ_CONFIG"})
    assert settings.gateway.session_timeout_ms == int(env["LLMQ_GATEWAY__SESSION_TIMEOUT_MS"]["value"])
    # Ready once it admits, not as soon as its web server answers.
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # More gateways than request partitions per band would get none to admit from.
    assert sts["spec"]["replicas"] <= settings.topics.request_partitions
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert sts["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]


def test_k8s_has_serve_the_lag_exporter_and_the_topics_job():
    docs = k8s_docs()
    kinds = {(d["kind"], d["metadata"]["name"]) for documents in docs.values() for d in documents}
    assert {("Deployment", "llmq-serve"), ("Service", "llmq-serve"), ("Deployment", "llmq-lag-exporter"),
            ("Job", "llmq-topics"), ("Secret", "llmq-model-api-key")} <= kinds
    # The alerts select on the lag exporter's job, which prometheus-kubernetes.yml takes from this label.
    (lag,) = [d for d in docs["lag-exporter.yaml"] if d["kind"] == "Deployment"]
    assert lag["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "llmq-lag-exporter"
    # Every llmq pod reads the ConfigMap made from deploy/llmq.toml.
    for c in k8s_containers(docs):
        assert _config_file(c) == (EXAMPLE_CONFIG, []), c.where
    readme = (K8S / "README.md").read_text()
    assert f"--from-file={CONFIG_KEY}=deploy/llmq.toml" in readme and CONFIG_MAP in readme


def test_the_k8s_readme_says_what_the_code_does():
    readme = (K8S / "README.md").read_text()
    defaults = Settings().worker
    # Workers use the consumer group protocol (KIP-848) unless told otherwise.
    assert defaults.group_protocol == "consumer" and "KIP-848" in readme
    assert "cooperative-sticky: only moved partitions pause" not in readme
    # KEDA watches the dispatch topics.
    assert "scaling on the consumer lag of the pool's dispatch topics" in readme
    assert f"({Settings().gateway.session_timeout_ms // 1000} s)" in readme
    for file in (p.name for p in K8S.glob("*.yaml")):
        assert f"`{file}`" in readme, f"README.md does not list {file}"


# -- the checks bite -------------------------------------------------------------------------------


def _service(compose: dict, name: str) -> dict:
    return compose["services"][name]


def test_a_renamed_flag_is_found():
    compose, docs, dockerfile = _shipped()
    changed = copy.deepcopy(compose)
    command = _service(changed, "worker")["command"]
    command[command.index("--metrics-port")] = "--metrics-prt"
    problems = deploy_problems(changed, docs, dockerfile)
    assert len(problems) == 1 and "docker-compose: worker" in problems[0] and "--metrics-prt" in problems[0]

    changed = copy.deepcopy(docs)
    (sts,) = [d for d in changed["gateway.yaml"] if d["kind"] == "StatefulSet"]
    sts["spec"]["template"]["spec"]["containers"][0]["command"][2] = "--instance"
    problems = deploy_problems(compose, changed, dockerfile)
    assert problems and all("gateway.yaml" in p for p in problems), problems


def test_a_renamed_or_unknown_variable_is_found():
    compose, docs, dockerfile = _shipped()
    changed = copy.deepcopy(compose)
    env = _service(changed, "worker")["environment"]
    env["LLMQ_WORKER__SOURCES"] = env.pop("LLMQ_WORKER__SOURCE")
    env["LLMQ_BOOTSTRAP_SERVERS"] = "kafka:19092"
    problems = deploy_problems(changed, docs, dockerfile)
    assert any("LLMQ_WORKER__SOURCES" in p or "worker.sources" in p for p in problems), problems
    assert any("LLMQ_BOOTSTRAP_SERVERS is read by nothing" in p for p in problems), problems
    assert deploy_problems(compose, docs, dockerfile + "\nENV LLMQ_SCHEMA_DIR=/x\n") == [
        "Dockerfile: LLMQ_SCHEMA_DIR is read by nothing in llmq"]


def test_a_value_llmq_refuses_is_found():
    compose, docs, dockerfile = _shipped()
    changed = copy.deepcopy(docs)
    (deployment, *_) = [d for d in changed["workers.yaml"] if d["kind"] == "Deployment"]
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    next(e for e in env if e["name"] == "LLMQ_WORKER__OPENAI_ROUTES")["value"] = "big=ftp://x"
    problems = deploy_problems(compose, changed, dockerfile)
    assert len(problems) == 1 and "worker.openai_routes" in problems[0], problems


def test_ports_that_disagree_are_found():
    compose, docs, dockerfile = _shipped()
    changed = copy.deepcopy(compose)
    serve = _service(changed, "serve")
    serve["command"][serve["command"].index("--port") + 1] = "8081"
    problems = deploy_problems(changed, docs, dockerfile)
    assert any("docker-compose: serve: serves on 8081" in p for p in problems), problems
    assert any("healthcheck asks port 8080" in p for p in problems), problems

    changed = copy.deepcopy(docs)
    (lag,) = [d for d in changed["lag-exporter.yaml"] if d["kind"] == "Deployment"]
    lag["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = "9101"
    container = lag["spec"]["template"]["spec"]["containers"][0]
    container["command"].remove("--metrics-addr")
    container["command"].remove("0.0.0.0")
    problems = deploy_problems(compose, changed, dockerfile)
    assert any("scraped on 9101, serves metrics on 9102" in p for p in problems), problems
    assert any("listens on 127.0.0.1" in p for p in problems), problems


def test_missing_health_checks_restart_policies_and_config_mounts_are_found():
    compose, docs, dockerfile = _shipped()
    changed = copy.deepcopy(compose)
    del _service(changed, "gateway-2")["healthcheck"]
    del _service(changed, "lag-exporter")["restart"]
    problems = deploy_problems(changed, docs, dockerfile)
    assert "docker-compose: gateway-2: no healthcheck on /healthz" in problems
    assert any(p.startswith("docker-compose: lag-exporter: no restart policy") for p in problems)

    changed = copy.deepcopy(docs)
    (serve,) = [d for d in changed["serve.yaml"] if d["kind"] == "Deployment"]
    container = serve["spec"]["template"]["spec"]["containers"][0]
    del container["readinessProbe"]
    container["volumeMounts"] = []
    problems = deploy_problems(compose, changed, dockerfile)
    assert any("serve" in p and "no readinessProbe on /readyz" in p for p in problems), problems
    assert any("LLMQ_CONFIG=/etc/llmq/config/llmq.toml is not the llmq.toml" in p for p in problems), problems


@pytest.mark.parametrize("target", ["web", 6066])
def test_a_service_targeting_an_undeclared_port_is_found(target):
    docs = k8s_docs()
    changed = copy.deepcopy(docs)
    (svc,) = [d for d in changed["serve.yaml"] if d["kind"] == "Service"]
    svc["spec"]["ports"][0]["targetPort"] = target
    assert service_problems(changed) == [
        f"deploy/k8s/serve.yaml: Service/llmq-serve targets {target}, which its pods do not declare"]
