"""The monitoring and deployment files under deploy/ stay valid and consistent with what the code exports.

* deploy/prometheus: rule files pass `promtool check rules`, every unit test file passes `promtool test rules`,
  every alert is covered by a firing and a silent test case, and only exported metrics are queried; the
  scrape configs reach the ports the processes serve on.
* deploy/grafana: the dashboard queries only exported metrics (or our recording rules), its PromQL parses, and
  the four seed signals per priority and the gateway have panels.
* Every PromQL expression (rules, dashboard, promtool tests and their input series) matches only label values
  llmq emits: outcomes, reason codes, statuses, bands, jobs... derived from the code that emits them.
* deploy/k8s: Deployments and KEDA ScaledObjects agree on pools, consumer groups, topics and partition limits,
  and the workers' environment is accepted by llmq's own settings loader; the gateway's scrape annotations,
  port and bind address agree with its settings.

The promtool tests skip when promtool is not on PATH (`make setup` installs it, so CI runs them).
"""

from __future__ import annotations

import ast
import functools
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
             "llmq_dead_letters_total", "llmq_preemptions_total", "llmq_time_to_first_token_seconds_bucket", "llmq_time_to_first_token_seconds_sum", "llmq_time_to_first_token_seconds_count", "llmq_inter_token_seconds_bucket", "llmq_inter_token_seconds_sum", "llmq_inter_token_seconds_count",
             "llmq_duplicate_requests_total", "llmq_lag_exporter_errors_total", "llmq_tenant_served_tokens_total",
             "llmq_backend_routes_total", "llmq_backend_route_deferrals_total", "llmq_backend_prompt_tokens_total",
             "llmq_backend_cached_prompt_tokens_total", "llmq_backend_kv_contradictions_total",
             "llmq_backend_prefix_index_corrections_total")
_HISTOGRAMS = ("llmq_queue_wait_seconds", "llmq_request_duration_seconds", "llmq_tenant_queue_wait_seconds",
               "llmq_backend_cached_tokens")
_GAUGES = (
    # workers
    "llmq_inflight_requests", "llmq_last_commit_timestamp_seconds", "llmq_worker_up",
    "llmq_tenant_fair_share_ratio", "llmq_worker_fairness_jain_index", "llmq_backend_prefix_cache_hit_ratio",
    # lag exporter, kafka_exporter-compatible
    "kafka_consumergroup_lag", "kafka_consumergroup_current_offset", "kafka_consumergroup_lag_sum",
    "kafka_topic_partition_current_offset", "kafka_consumergroup_members",
    # lag exporter, llmq's own
    "llmq_consumergroup_uncommitted_partitions", "llmq_consumergroup_lag_seconds", "llmq_queue_depth",
    "llmq_oldest_request_age_seconds", "llmq_band_consumers", "llmq_lag_exporter_refresh_seconds",
)
#: Only the gateway exports these (it exports llmq_requests_total, llmq_rejections_total and
#: llmq_dead_letters_total too, as the workers do).
_GATEWAY = (
    "llmq_gateway_degraded_total", "llmq_gateway_reprioritised_total", "llmq_gateway_finished_total",
    "llmq_gateway_queue_depth", "llmq_gateway_queue_cap", "llmq_gateway_eta_seconds", "llmq_gateway_drain_rate",
    "llmq_gateway_capacity", "llmq_gateway_arrival_rate", "llmq_gateway_load", "llmq_gateway_fairness_jain", "llmq_gateway_fairness_tenants",
    "llmq_gateway_shadow_decisions_total", "llmq_gateway_shadow_disagreements_total",
)
#: What a process did about its own stalls (pipeline/observability/health.py): workers and gateways.
_HEALTH = ("llmq_health_recoveries_total", "llmq_health_stalls_total")
_SHARED_WITH_THE_GATEWAY = ("llmq_requests_total", "llmq_rejections_total", "llmq_dead_letters_total") + _HEALTH
#: llmq serve's own (pipeline/serve/metrics.py).
_SERVE = ("llmq_serve_requests_total", "llmq_serve_request_seconds_bucket", "llmq_serve_request_seconds_sum",
          "llmq_serve_request_seconds_count", "llmq_serve_inflight", "llmq_serve_open_streams",
          "llmq_serve_responses_total", "llmq_serve_response_stream_resumes_total",
          "llmq_serve_responses_background_waiting")
EXPORTED = frozenset(_COUNTERS + _HEALTH + _GAUGES + _GATEWAY + _SERVE
                     + tuple(h + s for h in _HISTOGRAMS for s in ("_bucket", "_sum", "_count")))
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


def _exposition_names(registry) -> set[str]:
    names = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def test_worker_metric_names_match_the_code():
    """The worker part of EXPORTED is what WorkerMetrics registers (renames there break dashboards and alerts)."""
    from pipeline.observability.metrics import WorkerMetrics

    worker_names = {n for n in EXPORTED if n.startswith("llmq_") and n not in _GATEWAY + _SERVE and not n.startswith(
        ("llmq_consumergroup_", "llmq_queue_depth", "llmq_oldest_request_age", "llmq_band_consumers",
         "llmq_lag_exporter_"))}
    assert _exposition_names(WorkerMetrics().registry) == worker_names


def test_serve_metric_names_match_the_code():
    from types import SimpleNamespace

    from pipeline.serve.metrics import ServeMetrics

    assert _exposition_names(ServeMetrics(SimpleNamespace(inflight=0, streams=set())).registry) == set(_SERVE)


def test_gateway_metric_names_match_the_code():
    from pipeline.observability.metrics import GatewayMetrics

    assert _exposition_names(GatewayMetrics().registry) == set(_GATEWAY) | set(_SHARED_WITH_THE_GATEWAY)
    assert set(_SHARED_WITH_THE_GATEWAY) <= EXPORTED


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


#: The scrape jobs the rules and the dashboard select on.
JOBS = ("llmq-gateway", "llmq-workers", "llmq-lag-exporter", "llmq-serve")


def test_prometheus_config_scrapes_the_three_jobs_and_loads_the_rules():
    from pipeline.config.gateway import GatewaySettings
    from pipeline.config.worker import WorkerSettings

    config = _load_yaml(PROM / "prometheus.yml")
    jobs = {j["job_name"]: [t for sc in j.get("static_configs", []) for t in sc["targets"]]
            + [f"{n}:{sd['port']}" for sd in j.get("dns_sd_configs", []) for n in sd["names"]]
            for j in config["scrape_configs"]}
    # The gateways are the docker-compose services gateway-1 and gateway-2, on their web port.
    assert jobs == {"llmq-gateway": ["gateway-1:6066", "gateway-2:6066"], "llmq-workers": ["worker:9101"],
                    "llmq-lag-exporter": ["lag-exporter:9102"], "llmq-serve": ["serve:8080"]}
    assert {t.rsplit(":", 1)[1] for t in jobs["llmq-gateway"]} == {str(GatewaySettings().web_port)}
    assert jobs["llmq-workers"][0].endswith(f":{WorkerSettings().metrics_port}")
    assert sorted(config["rule_files"]) == sorted(p.name for p in RULE_FILES)
    for j in config["scrape_configs"]:
        assert j.get("metrics_path", "/metrics") == "/metrics", j["job_name"]
    # The alerts select on these job names.
    alerts_text = (PROM / "llmq-alerts.yml").read_text()
    assert 'job="llmq-lag-exporter"' in alerts_text and 'job="llmq-gateway"' in alerts_text
    assert set(jobs) == set(JOBS)


def _relabel(rules: list[dict], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus' keep/replace relabelling of one target (None: dropped), enough for prometheus-kubernetes.yml."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(n, "") for n in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep":
            if not match:
                return None
        elif action == "replace":
            if match:
                labels[rule["target_label"]] = re.sub(r"\$(\d+)", lambda m: match.group(int(m.group(1))) or "",
                                                      rule.get("replacement", "$1"))
        else:
            raise AssertionError(f"relabel action {action} is not simulated here")
    return labels


def _pod_targets(kind: str, name: str) -> list[tuple[dict, dict]]:
    """(pod template metadata, its first container) of every `kind` in deploy/k8s/`name`."""
    out = []
    for d in _docs(name, kind):
        template = d["spec"]["template"]
        out.append((template["metadata"], template["spec"]["containers"][0]))
    return out


def test_kubernetes_pod_discovery_finds_every_process_under_its_job_name():
    config = _load_yaml(PROM / "prometheus-kubernetes.yml")
    assert sorted(config["rule_files"]) == sorted(p.name for p in RULE_FILES)
    (job,) = config["scrape_configs"]
    rules = job["relabel_configs"]
    found = {}
    for kind, name in (("StatefulSet", "gateway.yaml"), ("Deployment", "workers.yaml"), ("Deployment", "serve.yaml"),
                       ("Deployment", "lag-exporter.yaml")):
        for meta, container in _pod_targets(kind, name):
            labels = {"__address__": "10.0.0.7", "__metrics_path__": "/metrics", "job": job["job_name"],
                      "__meta_kubernetes_pod_name": meta["labels"]["app.kubernetes.io/name"] + "-0",
                      "__meta_kubernetes_namespace": "llmq"}
            labels.update({"__meta_kubernetes_pod_label_" + re.sub(r"[^\w]", "_", k): v
                           for k, v in meta["labels"].items()})
            labels.update({"__meta_kubernetes_pod_annotation_" + re.sub(r"[^\w]", "_", k): v
                           for k, v in meta.get("annotations", {}).items()})
            target = _relabel(rules, labels)
            assert target is not None, f"{name}: pod not scraped"
            ports = {p["containerPort"] for p in container["ports"]}
            assert int(target["__address__"].rsplit(":", 1)[1]) in ports, name
            assert target["__metrics_path__"] == "/metrics"
            found[target["job"]] = target
    assert set(found) == set(JOBS)
    # An unrelated pod is not scraped.
    assert _relabel(rules, {"__address__": "10.0.0.8", "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true"}) is None


@needs_promtool
def test_promtool_check_kubernetes_config():
    proc = _run(PROMTOOL, "check", "config", str(PROM / "prometheus-kubernetes.yml"))
    if "kubernetes_sd_configs not found" in proc.stdout + proc.stderr:
        pytest.skip("this promtool is built without Kubernetes service discovery (Debian's is)")
    assert proc.returncode == 0, f"promtool check config failed:\n{proc.stdout}\n{proc.stderr}"


def test_k8s_gateway_serves_metrics_where_its_annotations_say():
    """deploy/k8s/gateway.yaml: scrape annotations, containerPort and the gateway's own web settings agree."""
    (meta, container), = _pod_targets("StatefulSet", "gateway.yaml")
    annotations = meta["annotations"]
    env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e and e["name"] != "LLMQ_CONFIG"}
    settings = Settings.load(ROOT / "deploy" / "llmq.toml", env=env)
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == settings.gateway.web_port == 6066
    assert settings.gateway.web_port in {p["containerPort"] for p in container["ports"]}
    assert settings.gateway.web_host == "0.0.0.0", "metrics must answer on the pod IP"


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
    # The gateway row shows every gateway series but the finished count (the workers' outcomes show that).
    for metric in set(_GATEWAY) - {"llmq_gateway_finished_total"}:
        assert metric in seen, f"no panel shows {metric}"


def test_dashboard_has_a_gateway_row():
    d = _dashboard()
    rows = [p for p in d["panels"] if p["type"] == "row"]
    assert "Gateway" in [r["title"] for r in rows]
    start = d["panels"].index(next(r for r in rows if r["title"] == "Gateway"))
    end = next((i for i, p in enumerate(d["panels"]) if i > start and p["type"] == "row"), len(d["panels"]))
    exprs = " ".join(_squash(t["expr"]) for p in d["panels"][start + 1:end] for t in p["targets"])
    for needle in ('llmq_requests_total{job="llmq-gateway",outcome="admitted"', "llmq_rejections_total{",
                   "by(reason)", "llmq_gateway_queue_depth", "llmq_gateway_queue_cap", "llmq_gateway_drain_rate",
                   "llmq_gateway_arrival_rate", "llmq_gateway_eta_seconds", "llmq_gateway_load",
                   "llmq_gateway_degraded_total", "llmq_gateway_fairness_jain"):
        assert needle in exprs, f"the gateway row shows no {needle}"


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
# Label values: every matcher asks for a value that something emits
# ---------------------------------------------------------------------------------------------------------
# `llmq_requests_total{outcome="degraded"}` is valid PromQL over an exported metric and matches nothing,
# forever: the checks above cannot see that. Here every matcher of every expression (rules, dashboard,
# promtool tests, their input series) is compared with the values the code emits, read from the code itself:
# the outcome strings passed to outcome()/requests.labels(), the reason codes of the refusals the gateway
# and the workers give, the dead-letter reasons of DecodeError, the statuses, bands, pools, buckets, the
# scrape jobs, the consumer groups and topics of the default settings. Grafana variables ($priority) are
# left out: they take their values at view time.
PIPELINE = ROOT / "pipeline"
#: Where the series of llmq_requests_total, llmq_rejections_total and friends are counted.
EMITTERS = ("gateway/*.py", "worker/**/*.py", "observability/metrics.py")
#: Labels whose values are not a fixed set (any value is fine in a matcher).
FREE = None


def _parsed(*patterns: str) -> list[ast.Module]:
    return [ast.parse(p.read_text(), str(p)) for pattern in patterns for p in sorted(PIPELINE.glob(pattern))]


def _func_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _receiver(call: ast.Call) -> str:
    """`metrics.requests.labels(...)` -> "requests"."""
    f = call.func
    if isinstance(f, ast.Attribute):
        v = f.value
        return v.attr if isinstance(v, ast.Attribute) else v.id if isinstance(v, ast.Name) else ""
    return ""


def _module_dicts(tree: ast.Module) -> dict[str, ast.Dict]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            out.update({t.id: node.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _strings(node: ast.AST, dicts: dict[str, ast.Dict]) -> set[str]:
    """The strings an argument can be: a literal, either arm of `a if c else b`, the default of
    `x.get(k, "d")`, or any value of a module-level dict literal it indexes."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _strings(node.body, dicts) | _strings(node.orelse, dicts)
    if isinstance(node, ast.Call) and _func_name(node) == "get" and len(node.args) == 2:
        return _strings(node.args[1], dicts)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in dicts:
        return {s for v in dicts[node.value.id].values for s in _strings(v, dicts)}
    return set()


def _leading_text(node: ast.AST) -> str | None:
    """The literal start of a string or f-string argument (None: not a string literal)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        assert isinstance(first, ast.Constant), f"an f-string reason without a leading code: {ast.unparse(node)}"
        return first.value
    return None


def _rejection_codes() -> set[str]:
    """reason_code() of every refusal that reaches llmq_rejections_total: the gateway's REJECT decisions
    (admission.py) and invalid requests (validation.py, also what the workers refuse), and the reasons the
    workers pass to Responder.reject()."""
    from pipeline.observability.metrics import reason_code

    texts = []
    for tree in _parsed("policy/admission.py"):
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and _func_name(node) == "Decision" and len(node.args) >= 2
                    and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "REJECT"):
                texts.append(_leading_text(node.args[1]))
    for tree in _parsed("policy/validation.py"):
        texts += [_leading_text(n.value) for n in ast.walk(tree) if isinstance(n, ast.Return) and n.value is not None]
    for tree in _parsed("worker/**/*.py"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _func_name(node) == "reject" and len(node.args) == 4:
                texts.append(_leading_text(node.args[3]))
    codes = {reason_code(t) for t in texts if t is not None}
    assert "other" not in codes, f"a refusal reason without a code: {texts}"
    return codes


def _dead_letter_reasons() -> set[str]:
    """The `reason` of every DecodeError (and subclass) raised with a literal one, and the literal reasons
    passed to the gateway's and the workers' dead_letter()."""
    from pipeline import errors

    decode_errors = {n for n, c in vars(errors).items() if isinstance(c, type) and issubclass(c, errors.DecodeError)}
    reasons = set()
    for tree in _parsed("**/*.py"):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _func_name(node)
            if name in decode_errors and node.args:
                reasons |= _strings(node.args[0], {})
            elif name in ("dead_letter", "_dead_letter"):
                reasons |= {s for a in node.args for s in _strings(a, {}) if re.fullmatch(r"[a-z][a-z_]*", s)}
    return reasons


def _series_objects():
    """(name, kind, label names, bucket bounds) of every series WorkerMetrics and GatewayMetrics define."""
    from pipeline.observability.metrics import GatewayMetrics, WorkerMetrics, _Series

    for metrics in (WorkerMetrics(), GatewayMetrics()):
        for s in vars(metrics).values():
            if isinstance(s, _Series):
                yield s.name, s.kind, s.labelnames, s.bucket_bounds


@functools.lru_cache(maxsize=None)
def _metric_labels() -> dict[str, set[str]]:
    """Exposition name -> the label names it carries (Prometheus adds job and instance)."""
    from types import SimpleNamespace

    from pipeline.observability.lag import LagCollector

    out: dict[str, set[str]] = {"up": set()}
    for name, kind, labelnames, _ in _series_objects():
        if kind == "counter":
            out.setdefault(name + "_total", set()).update(labelnames)
        elif kind == "histogram":
            out.setdefault(name + "_bucket", set()).update({*labelnames, "le"})
            for suffix in ("_sum", "_count"):
                out.setdefault(name + suffix, set()).update(labelnames)
        else:
            out.setdefault(name, set()).update(labelnames)
    for family in LagCollector(SimpleNamespace(settings=Settings())).collect():
        out[family.name + ("_total" if family.type == "counter" else "")] = set(family._labelnames)
    for labels in out.values():
        labels.update({"job", "instance"})
    # Recording rules: their own labels, the labels they aggregate by, and those of the series they read.
    rules = [r for g in _load_yaml(PROM / "llmq-recording.yml")["groups"] for r in g["rules"] if "record" in r]
    for _ in range(2):  # a rule may read one defined later
        for rule in rules:
            expr = str(rule["expr"])
            labels = set(rule.get("labels", {}))
            for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
                labels.update(x.strip() for x in group.split(",") if x.strip())
            for name in metric_names(expr):
                if name.startswith("llmq:"):
                    labels |= out.get(name, set())
            out.setdefault(rule["record"], set()).update(labels)
    return out


@functools.lru_cache(maxsize=None)
def _label_domains() -> tuple[dict[str, set[str] | None], dict[tuple[str, str], set[str]]]:
    """Label -> the values emitted (FREE: any), and (metric, label) -> values where they differ by metric."""
    from pipeline.config.topics import DEFAULT_POOLS
    from pipeline.models import Priority, Status
    from pipeline.observability.metrics import _fmt_bound

    priorities = {p.value for p in Priority}
    outcomes, kinds, actions, dead_letter_reasons = set(), set(), set(), _dead_letter_reasons()
    for tree in _parsed(*EMITTERS):
        dicts = _module_dicts(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name, receiver, args = _func_name(node), _receiver(node), node.args
            if (name == "outcome" or (name == "labels" and receiver == "requests")) and len(args) >= 2:
                priorities |= _strings(args[0], dicts)  # e.g. UNKNOWN, the band of an undecodable message
                outcomes |= _strings(args[1], dicts)
            elif name == "labels" and receiver == "tokens" and len(args) == 2:
                kinds |= _strings(args[1], dicts)
            elif name == "labels" and receiver == "duplicates" and args:
                actions |= _strings(args[0], dicts)
            elif name == "labels" and receiver == "dead_letters" and args:
                dead_letter_reasons |= _strings(args[0], dicts)

    settings = Settings()
    t = settings.topics
    severities = {r["labels"]["severity"] for r in _alert_rules()}
    for group in _load_yaml(PROM / "llmq-recording.yml")["groups"]:
        severities |= {r["labels"]["severity"] for r in group["rules"] if "severity" in r.get("labels", {})}
    domains: dict[str, set[str] | None] = {
        "priority": priorities,
        "requested": {p.value for p in Priority},
        "effective": {p.value for p in Priority},
        "outcome": outcomes,
        "kind": kinds,
        "action": actions,
        # Completions counts terminal responses, by their status in lower case.
        "status": {s.value.lower() for s in Status if s.is_terminal},
        "pool": set(DEFAULT_POOLS) | {"all"},
        "severity": severities,
        "job": set(JOBS),
        # The default consumer groups of the workers and of the gateways.
        "consumergroup": {*settings.worker.group_ids(), settings.gateway.app_id},
        "topic": {*t.request_topics, *t.dispatch_topics, t.responses, t.dlq, t.cancellations},
        "reason": FREE, "le": FREE,  # per metric, below
        "instance": FREE, "partition": FREE, "tenant": FREE, "model": FREE,
    }
    per_metric: dict[tuple[str, str], set[str]] = {
        ("llmq_rejections_total", "reason"): _rejection_codes(),
        ("llmq_dead_letters_total", "reason"): dead_letter_reasons,
    }
    for name, kind, _, bounds in _series_objects():
        if kind == "histogram":
            per_metric[(name + "_bucket", "le")] = {_fmt_bound(b) for b in bounds} | {"+Inf"}
    return domains, per_metric


_SELECTOR = re.compile(r'"(?:[^"\\]|\\.)*"|([A-Za-z_:][\w:]*)?\s*\{')
_MATCHER = re.compile(r'\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')


def selectors(expr: str) -> list[tuple[str | None, list[tuple[str, str, str]]]]:
    """(metric name or None, [(label, op, value)]) of every vector selector in ``expr``."""
    out = []
    for m in _SELECTOR.finditer(expr):
        if m.group(0).startswith('"'):
            continue
        pos, matchers = m.end(), []
        while True:
            mm = _MATCHER.match(expr, pos)
            if not mm:
                break
            matchers.append((mm.group(1), mm.group(2), re.sub(r"\\(.)", r"\1", mm.group(3))))
            pos = mm.end()
        assert expr[pos:].lstrip().startswith("}"), f"cannot read the matchers at {expr[m.start():pos + 20]!r}"
        out.append((m.group(1), matchers))
    return out


_REGEX_CHARS = re.compile(r"[.*+?()\[\]{}^$\\|]")


def label_problems(expr: str, *, series_input: bool = False, domains=None) -> list[str]:
    """What in ``expr`` asks for a label or value nothing emits. ``series_input``: ``expr`` is an input
    series of a promtool test, where consumer groups and topics are anything the lag exporter may see."""
    domains, per_metric = domains or _label_domains()
    labels_of = _metric_labels()
    problems = []
    for metric, matchers in selectors(expr):
        for label, op, value in matchers:
            if label == "__name__" or "$" in value:
                continue
            if metric is not None and metric in labels_of and label not in labels_of[metric]:
                problems.append(f"{metric} has no label {label!r}")
                continue
            if label not in domains:
                problems.append(f"label {label!r} is unknown to this test: add its values to _label_domains()")
                continue
            allowed = per_metric.get((metric, label), domains[label])
            if allowed is FREE or (series_input and label in ("consumergroup", "topic")):
                continue
            # A regex is checked per top-level alternative (one with groups as a whole).
            alternatives = value.split("|") if op in ("=~", "!~") and not re.search(r"[()]", value) else [value]
            for alt in alternatives:
                if op in ("=", "!=") or not _REGEX_CHARS.search(alt):
                    ok = alt in allowed
                else:
                    ok = any(re.fullmatch(alt, v) for v in allowed)
                if not ok:
                    problems.append(f"{metric or '{}'}{{{label}{op}{value!r}}}: nothing emits {label}={alt!r} "
                                    f"(emitted: {sorted(allowed)})")
    return problems


def _every_expression() -> list[tuple[str, str, bool]]:
    """(where, PromQL, is an input series) of the rules, the dashboard and the promtool tests."""
    out = []
    for path in RULE_FILES:
        for group in _load_yaml(path)["groups"]:
            for rule in group["rules"]:
                out.append((f"{path.name} {rule.get('alert') or rule.get('record')}", str(rule["expr"]), False))
    for panel, target in _targets(_dashboard()):
        out.append((f"dashboard panel {panel['title']!r}", target["expr"], False))
    for path in PROM_TESTS:
        for test in _load_yaml(path).get("tests", []):
            for series in test.get("input_series", []) or []:
                out.append((f"{path.name} input", series["series"], True))
            for case in test.get("promql_expr_test", []) or []:
                out.append((f"{path.name} promql_expr_test", str(case["expr"]), False))
    return out


def test_the_emitted_label_values_are_read_from_the_code():
    domains, per_metric = _label_domains()
    assert {"admitted", "completed", "rejected", "expired", "failed", "cancelled", "duplicate", "redelivered",
            "dead_lettered"} <= domains["outcome"]
    assert "degraded" not in domains["outcome"], "the gateway counts degradation in llmq_gateway_degraded_total"
    assert "UNKNOWN" in domains["priority"]
    assert domains["kind"] == {"prompt", "completion"}
    assert domains["action"] == {"dropped", "repeated"}
    assert {"rate_limited", "queue_full", "quota_exceeded", "invalid_request",
            "duplicate_request_id"} <= per_metric[("llmq_rejections_total", "reason")]
    assert {"truncated", "bad_magic", "gateway_error", "unknown_fingerprint"} <= per_metric[
        ("llmq_dead_letters_total", "reason")]
    assert {"completed", "failed"} <= domains["status"] and "queued" not in domains["status"]
    assert per_metric[("llmq_queue_wait_seconds_bucket", "le")] >= {"0.005", "1800.0", "+Inf"}


def test_label_check_catches_what_nothing_emits():
    domains = _label_domains()

    def problems(expr):
        return label_problems(expr, domains=domains)

    assert problems('sum(rate(llmq_requests_total{outcome="degraded"}[5m]))')
    assert problems('llmq_rejections_total{reason="unauthorized"}')
    assert problems('llmq_rejections_total{reason="truncated"}')  # a dead-letter reason, not a refusal's
    assert problems('llmq_requests_total{outcome!~"admitted|degradedd"}')
    assert problems('llmq_gateway_load{pool="realtime"}')  # no such label on that metric
    assert problems('up{job="gateway"}')
    assert problems('kafka_consumergroup_lag{consumergroup=~"billing-.+"}')
    assert problems('llmq_queue_wait_seconds_bucket{le="0.3"}')
    assert not problems('sum by (reason) (rate(llmq_rejections_total{reason=~"rate_limited|queue_full",'
                        'priority="CRITICAL"}[5m])) / on () group_left sum(llmq_requests_total{outcome="admitted",'
                        'priority=~"$priority"})')
    assert not problems('kafka_consumergroup_lag{consumergroup=~"llmq-pool-.+",topic=~".+\\\\.requests\\\\..+"}')
    assert not problems('llmq:queue_depth:threshold{severity="warning",priority="HIGH"}')
    assert selectors('a{x="}",y=~"b|c"} + rate(b[5m]) + {z!="q"}') == [
        ("a", [("x", "=", "}"), ("y", "=~", "b|c")]), (None, [("z", "!=", "q")])]


def test_every_expression_matches_only_emitted_label_values():
    domains = _label_domains()
    problems = []
    for where, expr, series_input in _every_expression():
        problems += [f"{where}: {p}" for p in label_problems(expr, series_input=series_input, domains=domains)]
    assert not problems, "\n".join(problems)


def test_promtool_test_inputs_are_series_llmq_exports():
    allowed = EXPORTED | PROMETHEUS_OWN
    for where, expr, series_input in _every_expression():
        if series_input:
            assert metric_names(expr) <= allowed, f"{where}: {expr} is no series llmq exports"


# ---------------------------------------------------------------------------------------------------------
# Kubernetes: worker Deployments and KEDA ScaledObjects
# ---------------------------------------------------------------------------------------------------------
def _docs(name: str, kind: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d and d.get("kind") == kind]


def _deployments() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _docs("workers.yaml", "Deployment")}


def _container_env(deployment: dict) -> dict[str, str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    # LLMQ_CONFIG names the ConfigMap made from deploy/llmq.toml (test_deploy_files.py checks the mount).
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e and e["name"] != "LLMQ_CONFIG"}


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
    assert min(topics.request_partitions, topics.dispatch_partitions) >= DOCUMENTED_PARTITIONS, (
        "deploy/k8s documents at least 6 partitions per request and dispatch topic")
    # The shipped pools sit behind the gateway and read what it admitted.
    band_topics = dict(zip(PRIORITIES, topics.dispatch_topics))
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
