"""The monitoring and deployment files under deploy/ stay valid and consistent with what the code exports.

* deploy/prometheus: rule files pass `promtool check rules`, every unit test file passes `promtool test rules`,
  every alert is covered by a firing and a silent test case, and only exported metrics are queried.
* deploy/grafana: the dashboard queries only exported metrics (or our recording rules), its PromQL parses, and
  the four seed signals per priority have panels.
* deploy/k8s: Deployments and KEDA ScaledObjects agree on pools, consumer groups, topics and partition limits,
  and the workers' environment is accepted by llmq's own settings loader.

The promtool tests skip when promtool is not on PATH (`make setup` installs it, so CI runs them).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline.config import Settings

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
RULE_FILES = [PROM / "llmq-recording.yml", PROM / "llmq-alerts.yml"]
PROM_TESTS = sorted((PROM / "tests").glob("*.yml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "llmq.json"
K8S = ROOT / "deploy" / "k8s"

def _find_promtool() -> str | None:
    # On PATH (make test puts the cached copy there), else where `make setup` unpacked it.
    from pipeline.broker import cache_root

    cached = cache_root() / "prometheus" / "usr" / "bin" / "promtool"
    return shutil.which("promtool") or (str(cached) if cached.exists() else None)


PROMTOOL = _find_promtool()
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not found on PATH (installed by `make setup`; Debian package 'prometheus')")

PRIORITIES = ("CRITICAL", "HIGH", "NORMAL", "LOW", "BACKGROUND")
POOLS = ("realtime", "async", "background")
#: Partitions per request topic, as documented in deploy/k8s (README.md, keda-scaledobjects.yaml).
DOCUMENTED_PARTITIONS = 6

# ---------------------------------------------------------------------------------------------------------
# The metric names llmq processes export (Prometheus exposition names), and nothing else.
# ---------------------------------------------------------------------------------------------------------
_COUNTERS = ("llmq_requests_total", "llmq_rejections_total", "llmq_tokens_total", "llmq_rebalances_total",
             "llmq_dead_letters_total", "llmq_preemptions_total", "llmq_duplicate_requests_total", "llmq_lag_exporter_errors_total")
_HISTOGRAMS = ("llmq_queue_wait_seconds", "llmq_request_duration_seconds", "llmq_tenant_queue_wait_seconds")
_GAUGES = (
    # workers
    "llmq_inflight_requests", "llmq_last_commit_timestamp_seconds", "llmq_worker_up",
    # lag exporter, kafka_exporter-compatible
    "kafka_consumergroup_lag", "kafka_consumergroup_current_offset", "kafka_consumergroup_lag_sum",
    "kafka_topic_partition_current_offset", "kafka_consumergroup_members",
    # lag exporter, llmq's own
    "llmq_consumergroup_uncommitted_partitions", "llmq_consumergroup_lag_seconds", "llmq_queue_depth",
    "llmq_oldest_request_age_seconds", "llmq_band_consumers", "llmq_lag_exporter_refresh_seconds",
)
EXPORTED = frozenset(_COUNTERS + _GAUGES + tuple(h + s for h in _HISTOGRAMS for s in ("_bucket", "_sum", "_count")))
#: Series Prometheus itself adds for every target.
PROMETHEUS_OWN = frozenset({"up"})

_PROMQL_WORDS = frozenset({
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
    "inf", "nan", "atan2", "start", "end",
})


def _load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def _recording_names() -> set[str]:
    return {r["record"] for g in _load_yaml(PROM / "llmq-recording.yml")["groups"] for r in g["rules"] if "record" in r}


def _alert_rules() -> list[dict]:
    return [r for g in _load_yaml(PROM / "llmq-alerts.yml")["groups"] for r in g["rules"] if "alert" in r]


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords, labels and Grafana variables ignored)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)                                               # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                                              # ranges, subqueries
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    s = re.sub(r"\$\{?\w+\}?", " ", s)                                             # Grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.95, sum by (priority, le) (rate(llmq_queue_wait_seconds_bucket'
            '{priority=~"$priority",job="x"}[$__rate_interval]))) > on (priority) group_left () '
            'llmq:queue_wait_seconds:slo_p95{severity="warning"} and time() - llmq_worker_up offset 10m > 1e3')
    assert metric_names(expr) == {"llmq_queue_wait_seconds_bucket", "llmq:queue_wait_seconds:slo_p95",
                                  "llmq_worker_up"}
    assert metric_names('topk(10, max(foo_bar) by (instance))') == {"foo_bar"}


def test_worker_metric_names_match_the_code():
    """The worker part of EXPORTED is what WorkerMetrics registers (renames there break dashboards and alerts)."""
    from pipeline.observability.metrics import WorkerMetrics

    names = set()
    for family in WorkerMetrics().registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    worker_names = {n for n in EXPORTED if n.startswith("llmq_") and not n.startswith(
        ("llmq_consumergroup_", "llmq_queue_depth", "llmq_oldest_request_age", "llmq_band_consumers",
         "llmq_lag_exporter_"))}
    assert names == worker_names


# ---------------------------------------------------------------------------------------------------------
# Prometheus rules
# ---------------------------------------------------------------------------------------------------------
def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=PROM, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_check_rules():
    proc = _run(PROMTOOL, "check", "rules", *(str(p) for p in RULE_FILES))
    assert proc.returncode == 0, f"promtool check rules failed:\n{proc.stdout}\n{proc.stderr}"


@needs_promtool
def test_promtool_check_config():
    proc = _run(PROMTOOL, "check", "config", str(PROM / "prometheus.yml"))
    assert proc.returncode == 0, f"promtool check config failed:\n{proc.stdout}\n{proc.stderr}"


def test_there_are_promtool_unit_tests():
    assert len(PROM_TESTS) >= 2


@needs_promtool
@pytest.mark.parametrize("test_file", PROM_TESTS, ids=[p.name for p in PROM_TESTS])
def test_promtool_unit_tests(test_file):
    proc = _run(PROMTOOL, "test", "rules", str(test_file))
    assert proc.returncode == 0, f"promtool test rules {test_file.name} failed:\n{proc.stdout}\n{proc.stderr}"


def test_alerts_have_severity_and_annotations():
    alerts = _alert_rules()
    assert alerts
    for rule in alerts:
        name = rule["alert"]
        assert re.fullmatch(r"Llmq[A-Za-z]+", name), name
        assert rule.get("labels", {}).get("severity") in ("warning", "critical"), name
        annotations = rule.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            assert annotations.get(key, "").strip(), f"{name}: missing annotation {key}"
    severities = {r["labels"]["severity"] for r in alerts}
    assert severities == {"warning", "critical"}


def test_rules_query_only_exported_metrics_and_recording_rules():
    allowed = EXPORTED | PROMETHEUS_OWN | _recording_names()
    for path in RULE_FILES:
        for group in _load_yaml(path)["groups"]:
            for rule in group["rules"]:
                unknown = metric_names(str(rule["expr"])) - allowed
                assert not unknown, f"{path.name} {rule.get('alert') or rule.get('record')}: unknown {unknown}"


def test_wait_slos_cover_every_band_and_sit_on_histogram_buckets():
    from pipeline.observability.metrics import WAIT_BUCKETS

    slos = {}
    for group in _load_yaml(PROM / "llmq-recording.yml")["groups"]:
        for rule in group["rules"]:
            if rule.get("record") == "llmq:queue_wait_seconds:slo_p95":
                value = float(re.fullmatch(r"vector\((.+)\)", rule["expr"]).group(1))
                slos[(rule["labels"]["priority"], rule["labels"]["severity"])] = value
    assert set(slos) == {(p, s) for p in PRIORITIES for s in ("warning", "critical")}
    for key, value in slos.items():
        assert value in WAIT_BUCKETS, f"SLO {key}={value} is not a bucket boundary of llmq_queue_wait_seconds"


def _alert_test_cases():
    """(file, alertname, eval_time, expected alerts) for every alert_rule_test in the promtool test files."""
    for path in PROM_TESTS:
        doc = _load_yaml(path)
        for test in doc.get("tests", []):
            for case in test.get("alert_rule_test", []) or []:
                yield path.name, case["alertname"], case["eval_time"], case.get("exp_alerts") or []


def test_promtool_test_files_load_both_rule_files():
    for path in PROM_TESTS:
        files = {(path.parent / f).resolve() for f in _load_yaml(path)["rule_files"]}
        assert (PROM / "llmq-recording.yml").resolve() in files, path.name
        for f in files:
            assert f.is_file(), f"{path.name}: {f} does not exist"


def test_every_alert_has_a_firing_and_a_silent_test_case():
    cases = list(_alert_test_cases())
    names = {r["alert"] for r in _alert_rules()}
    for name in sorted(names):
        mine = [c for c in cases if c[1] == name]
        assert any(c[3] for c in mine), f"{name}: no test case where it fires"
        assert any(not c[3] for c in mine), f"{name}: no test case where it stays silent"
        for _, _, _, expected in mine:
            for alert in expected:
                assert alert["exp_labels"]["alertname"] == name
                assert set(alert["exp_annotations"]) >= {"summary", "description", "runbook"}
    assert {c[1] for c in cases} <= names, "tests for alerts that do not exist"


def test_two_level_alerts_are_tested_at_the_boundary():
    """Alerts with a warning and a critical rule: some case fires the warning alone, some the critical."""
    levels: dict[str, set[str]] = {}
    for rule in _alert_rules():
        levels.setdefault(rule["alert"], set()).add(rule["labels"]["severity"])
    for name, sev in levels.items():
        if sev != {"warning", "critical"}:
            continue
        keyed = []
        for _, alertname, _, expected in _alert_test_cases():
            if alertname != name:
                continue
            by_key: dict[tuple, set[str]] = {}
            for alert in expected:
                labels = {k: v for k, v in alert["exp_labels"].items() if k != "severity"}
                by_key.setdefault(tuple(sorted(labels.items())), set()).add(alert["exp_labels"]["severity"])
            keyed.extend(by_key.values())
        assert {"warning"} in keyed, f"{name}: no case where the warning fires without the critical"
        assert any("critical" in k for k in keyed), f"{name}: no case where the critical level fires"


def test_prometheus_config_scrapes_the_three_jobs_and_loads_the_rules():
    config = _load_yaml(PROM / "prometheus.yml")
    jobs = {j["job_name"]: [t for sc in j.get("static_configs", []) for t in sc["targets"]]
            for j in config["scrape_configs"]}
    assert jobs == {"llmq-gateway": ["gateway:9100"], "llmq-workers": ["worker:9101"],
                    "llmq-lag-exporter": ["lag-exporter:9102"]}
    assert sorted(config["rule_files"]) == sorted(p.name for p in RULE_FILES)
    # The alerts select on these job names.
    alerts_text = (PROM / "llmq-alerts.yml").read_text()
    assert 'job="llmq-lag-exporter"' in alerts_text


# ---------------------------------------------------------------------------------------------------------
# Grafana
# ---------------------------------------------------------------------------------------------------------
def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold their panels


def _targets(dashboard: dict):
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            yield panel, target


def test_dashboard_structure_and_variables():
    d = _dashboard()
    assert 36 <= d["schemaVersion"] <= 41
    assert d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["priority"]["multi"] and variables["priority"]["includeAll"]
    assert variables["priority"]["query"].split(",") == list(PRIORITIES)
    ids = [p["id"] for p in _panels(d)]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel in _panels(d):
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel.get("targets"), f"panel {panel['title']!r} has no query"
    for panel, target in _targets(d):
        assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_queries_only_exported_metrics():
    allowed = EXPORTED | _recording_names()
    seen = set()
    for panel, target in _targets(_dashboard()):
        names = metric_names(target["expr"])
        assert names, f"{panel['title']}: no metric in {target['expr']!r}"
        unknown = names - allowed
        assert not unknown, f"panel {panel['title']!r} queries unknown metrics {unknown}: {target['expr']}"
        seen |= names
    # The panels the dashboard promises.
    for metric in ("kafka_consumergroup_lag_sum", "llmq_consumergroup_lag_seconds", "llmq_rejections_total",
                   "llmq_tenant_queue_wait_seconds_bucket", "llmq_inflight_requests",
                   "llmq_last_commit_timestamp_seconds", "llmq_band_consumers", "llmq_tokens_total"):
        assert metric in seen, f"no panel shows {metric}"


def _squash(expr: str) -> str:
    return re.sub(r"\s+", "", expr)


def test_dashboard_has_the_four_seed_signals_per_priority():
    panels = {}
    for panel, target in _targets(_dashboard()):
        panels.setdefault(panel["title"], []).append(_squash(target["expr"]))

    def has_panel(predicate) -> bool:
        return any(all(f in " ".join(exprs) for f in ("by(priority", "$priority")) and predicate(exprs)
                   for exprs in panels.values())

    signals = {
        "queue depth": lambda ex: any("llmq_queue_depth{" in e for e in ex),
        "queue wait (p95 and average)": lambda ex: (
            any("histogram_quantile(0.95" in e and "llmq_queue_wait_seconds_bucket" in e for e in ex)
            and any("llmq_queue_wait_seconds_sum" in e and "llmq_queue_wait_seconds_count" in e for e in ex)),
        "processing rate": lambda ex: any(
            'llmq_requests_total{outcome="completed"' in e and "rate(" in e and "/" not in e for e in ex),
        "rejection ratio": lambda ex: any(
            'outcome="rejected"' in e and "/" in e
            and all(o in e for o in ("completed", "expired", "failed", "cancelled")) for e in ex),
    }
    missing = [name for name, predicate in signals.items() if not has_panel(predicate)]
    assert not missing, f"no per-priority panel for: {missing}"


@needs_promtool
def test_dashboard_promql_parses(tmp_path):
    """Every dashboard query, with Grafana's variables filled in, is valid PromQL (checked by promtool)."""
    rules = []
    for i, (panel, target) in enumerate(_targets(_dashboard())):
        expr = (target["expr"].replace("$__rate_interval", "1m").replace("$__range", "1h")
                .replace("$priority", "CRITICAL|HIGH"))
        rules.append({"record": f"dashboard:query:{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = _run(PROMTOOL, "check", "rules", str(path))
    assert proc.returncode == 0, f"dashboard PromQL does not parse:\n{proc.stdout}\n{proc.stderr}"


def test_grafana_provisioning():
    ds = _load_yaml(ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    (prom,) = [d for d in ds["datasources"] if d["type"] == "prometheus"]
    assert prom["url"] == "http://prometheus:9090"
    dashboards = _load_yaml(ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "llmq.yml")
    (provider,) = dashboards["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


# ---------------------------------------------------------------------------------------------------------
# Kubernetes: worker Deployments and KEDA ScaledObjects
# ---------------------------------------------------------------------------------------------------------
def _docs(name: str, kind: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d and d.get("kind") == kind]


def _deployments() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _docs("workers.yaml", "Deployment")}


def _container_env(deployment: dict) -> dict[str, str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def test_worker_deployments():
    deployments = _deployments()
    assert set(deployments) == {f"llmq-worker-{p}" for p in POOLS}
    for pool in POOLS:
        d = deployments[f"llmq-worker-{pool}"]
        assert "replicas" not in d["spec"], "KEDA owns the replica count"
        pod = d["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["command"] == ["llmq", "worker", "--pool", pool]
        env = _container_env(d)
        assert env["LLMQ_BOOTSTRAP"]
        # llmq's own loader accepts the environment (unknown keys and bad values raise).
        settings = Settings.load(env=env)
        assert settings.worker.group_id == f"llmq-pool-{pool}"
        assert pod["terminationGracePeriodSeconds"] >= settings.worker.shutdown_grace_s + 5, (
            f"{pool}: the kubelet would kill workers still finishing in-flight requests or committing")
        ports = {p["containerPort"] for p in container["ports"]}
        assert settings.worker.metrics_port in ports
        assert settings.worker.metrics_addr == "0.0.0.0", "metrics must answer on the pod IP"
        labels = d["spec"]["selector"]["matchLabels"]
        assert labels.items() <= d["spec"]["template"]["metadata"]["labels"].items()


def test_keda_scaled_objects_match_pools_groups_topics_and_partitions():
    deployments = _deployments()
    scaled = _docs("keda-scaledobjects.yaml", "ScaledObject")
    topics = Settings().topics
    partitions = topics.request_partitions
    assert partitions >= DOCUMENTED_PARTITIONS, "deploy/k8s documents 6 partitions per request topic"
    band_topics = dict(zip(PRIORITIES, topics.request_topics))
    assert all(t.endswith("." + p.lower()) for p, t in band_topics.items())

    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == set(deployments)
    thresholds: dict[str, int] = {}
    for so in scaled:
        spec = so["spec"]
        target = spec["scaleTargetRef"]["name"]
        pool = target.removeprefix("llmq-worker-")
        env = _container_env(deployments[target])
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        assert spec["maxReplicaCount"] <= DOCUMENTED_PARTITIONS, (
            f"{pool}: more replicas than partitions per topic would sit idle")
        assert spec["triggers"], pool
        for trigger in spec["triggers"]:
            assert trigger["type"] == "kafka"
            meta = trigger["metadata"]
            assert meta["consumerGroup"] == f"llmq-pool-{pool}" == env["LLMQ_WORKER__GROUP_ID"]
            assert meta["bootstrapServers"] == env["LLMQ_BOOTSTRAP"]
            assert meta["topic"] in band_topics.values(), meta["topic"]
            assert meta["offsetResetPolicy"] == "earliest"
            assert str(meta.get("allowIdleConsumers", "false")).lower() == "false"
            assert int(meta["activationLagThreshold"]) >= 0
            assert all(isinstance(v, str) for v in meta.values()), "KEDA trigger metadata values are strings"
            assert meta["topic"] not in thresholds, f"{meta['topic']} is scaled by two pools"
            thresholds[meta["topic"]] = int(meta["lagThreshold"])
    # Every band is served by exactly one pool, and lower bands tolerate more lag per replica.
    assert set(thresholds) == set(band_topics.values())
    ordered = [thresholds[band_topics[p]] for p in PRIORITIES]
    assert ordered == sorted(ordered) and len(set(ordered)) == len(ordered), ordered


def test_k8s_readme_documents_the_partition_limit():
    text = (K8S / "README.md").read_text()
    assert f"**{DOCUMENTED_PARTITIONS} partitions**" in text
    assert "allowIdleConsumers" in text and "maxReplicaCount" in text
