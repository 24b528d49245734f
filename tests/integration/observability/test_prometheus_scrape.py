"""A real Prometheus server scrapes a worker, the lag exporter and a gateway while a load runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from pipeline.client import LlmqClient
from pipeline.models import Priority, Request, Status
from pipeline.observability.lag import LagCollector, LagReader, build_registry
from pipeline.observability.metrics import serve
from pipeline.serde import Codec
from tests.integration.gateway.test_gateway import running_gateway
from tests.integration.harness import free_port, read_topic, running_worker

ROOT = Path(__file__).resolve().parents[3]
RULE_FILES = [ROOT / "deploy" / "prometheus" / "llmq-recording.yml", ROOT / "deploy" / "prometheus" / "llmq-alerts.yml"]

def _find_prometheus() -> str | None:
    # On PATH (make test puts the cached copy there), else where `make setup` unpacked it.
    from pipeline.broker import cache_root

    cached = cache_root() / "prometheus" / "usr" / "bin" / "prometheus"
    return shutil.which("prometheus") or (str(cached) if cached.exists() else None)


PROMETHEUS = _find_prometheus()


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus on a free loopback port; yields (start(targets, rule_files) -> query function)."""
    if PROMETHEUS is None:
        pytest.fail("the prometheus binary is missing: `make setup` installs Debian's prometheus package")
    procs = []

    def start(targets: dict[str, int], rule_files=()):
        port = free_port()
        jobs = "\n".join(f"  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{p}']"
                         for job, p in targets.items())
        rules = "".join(f"\n  - {json.dumps(str(f))}" for f in rule_files)
        config = tmp_path / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                          f"rule_files:{rules or ' []'}\nscrape_configs:\n{jobs}\n")
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"

        def query(expr: str) -> list:
            url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            body = json.loads(urllib.request.urlopen(url, timeout=5).read())
            assert body["status"] == "success", body
            return body["data"]["result"]

        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/-/ready", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError((tmp_path / "prometheus.log").read_text()[-2000:])
                time.sleep(0.2)
        return query

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def _scalar(result: list) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def _eventually(fn, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_prometheus_sees_lag_waits_and_rejection_ratio_as_counted(settings, prometheus):
    group = settings.worker.group_id
    collector = LagCollector(LagReader(settings, group_pattern=f"^{group}$"), interval_s=1.0).start()
    lag_port = free_port()
    serve(build_registry(collector), lag_port)
    statuses: dict[str, Status] = {}
    with running_worker(settings) as worker:
        worker_port = free_port()
        serve(worker.metrics.registry, worker_port)
        query = prometheus({"llmq-workers": worker_port, "llmq-lag-exporter": lag_port})
        with LlmqClient(settings) as client:
            reqs = []
            for i in range(200):
                req = Request.new(f"tenant-{i % 9}", f"load {i}", priority=list(Priority)[i % 5],
                                  max_tokens=0 if i % 10 == 0 else 16)  # every tenth is invalid → REJECTED
                reqs.append(req)
                client.submit_nowait(req)
            for req in reqs:
                statuses[req.request_id] = client.result(req.request_id, timeout=30).status
        rejected = sum(1 for s in statuses.values() if s is Status.REJECTED)
        assert rejected == 20

        def waits_and_ratio():
            for band in Priority:
                assert _scalar(query(f'sum(llmq_queue_wait_seconds_count{{priority="{band.value}"}})')) > 0, band
            ratio = _scalar(query('sum(llmq_rejections_total) / sum(llmq_requests_total{outcome=~'
                                  '"completed|rejected|expired|failed|cancelled"})'))
            assert ratio == pytest.approx(rejected / len(statuses))

        _eventually(waits_and_ratio)

    # Workers stopped: new requests pile up as lag the group has not consumed.
    with LlmqClient(settings, listen=False) as client:
        for fut in [client.submit_nowait(Request.new("tenant-late", f"late {i}", priority=Priority.HIGH), track=False)
                    for i in range(30)]:
            fut.result(10)

    def lag_matches_admin():
        admin_lag = sum(p.lag for p in LagReader(settings, group_pattern=f"^{group}$").snapshot().partitions)
        assert admin_lag == 30
        assert _scalar(query(f'sum(kafka_consumergroup_lag_sum{{consumergroup="{group}"}})')) == admin_lag
        assert _scalar(query('llmq_queue_depth{priority="HIGH"}')) == 30
        assert _scalar(query('llmq_oldest_request_age_seconds{priority="HIGH"}')) >= 0
        assert _scalar(query(f'kafka_consumergroup_members{{consumergroup="{group}"}}')) == 0

    try:
        _eventually(lag_matches_admin, timeout=30)
    finally:
        collector.stop()


def test_prometheus_scrapes_the_gateway_and_the_rules_read_its_series(settings, prometheus, tmp_path):
    """The gateway process as deployed, its web port scraped: admissions and refusals as the clients saw them,
    its band gauges, and the recording rules over its series (the degraded share is the gateway's)."""
    settings.worker.source = "dispatch"
    gateway_port = free_port()
    reqs = []
    for i in range(60):
        band = list(Priority)[i % 5]
        # Every sixth is invalid (max_tokens 0): refused by the gateway, invalid_request.
        reqs.append(Request.new(f"tenant-{i % 4}", f"through the gateway {i}", priority=band, timeout_ms=600_000,
                                max_tokens=0 if i % 6 == 5 else 8))
    with running_gateway(settings, tmp_path, env={"LLMQ_GATEWAY__WEB_PORT": str(gateway_port)}), \
            running_worker(settings) as worker:
        worker_port = free_port()
        serve(worker.metrics.registry, worker_port)
        query = prometheus({"llmq-gateway": gateway_port, "llmq-workers": worker_port}, RULE_FILES)

        def baseline_scraped():  # the zero every band's admissions start from, before any is sent
            assert len(query('llmq_requests_total{job="llmq-gateway",outcome="admitted"} == 0')) == len(Priority)

        _eventually(baseline_scraped, timeout=60)
        with LlmqClient(settings, listen=False) as client:
            # In three waves a few scrapes apart: a counter's first sample is no increase to rate(), so
            # the admissions after it make the rates the recording rules divide by.
            for wave in range(3):
                for fut in [client.submit_nowait(req, track=False) for req in reqs[wave * 20:(wave + 1) * 20]]:
                    fut.result(10)
                time.sleep(2.5)
        # The answers as written, whichever partition each went to.
        ids = {r.request_id for r in reqs}
        codec = Codec.default()

        def terminal(messages):
            return {r.request_id: r for r in map(codec.decode_response, (m.value() for m in messages))
                    if r.request_id in ids and r.status.is_terminal}

        answers = terminal(read_topic(settings.kafka.bootstrap, settings.topics.responses, timeout=60,
                                      until=lambda ms: len(terminal(ms)) == len(ids)))
        completed = sum(a.status is Status.COMPLETED for a in answers.values())
        refused = [a for a in answers.values() if a.status is Status.REJECTED]
        assert completed == 50 and len(refused) == 10
        assert all(a.reason.startswith("invalid_request") for a in refused)

        def gateway_series():
            assert _scalar(query('up{job="llmq-gateway"}')) == 1
            assert _scalar(query('sum(llmq_requests_total{job="llmq-gateway",outcome="admitted"})')) == completed
            assert _scalar(query('sum(llmq_rejections_total{job="llmq-gateway",reason="invalid_request"})')) == 10
            for band in Priority:
                admitted = query(f'llmq_requests_total{{job="llmq-gateway",outcome="admitted",priority="{band.value}"}}')
                assert _scalar(admitted) == 10, band
            # A gateway gauge per band, from its 0.2-s timer.
            depths = query('llmq_gateway_queue_depth{job="llmq-gateway"}')
            assert {r["metric"]["priority"] for r in depths} == {p.value for p in Priority}
            assert all(float(r["value"][1]) >= 0 for r in depths)
            assert _scalar(query('llmq_gateway_drain_rate{job="llmq-gateway"}')) >= 0
            # The recording rule over the gateway's series: nothing was degraded, an explicit 0 per band.
            shares = query("llmq:degraded_share:ratio_rate5m")
            assert {r["metric"]["priority"] for r in shares} == {p.value for p in Priority}
            assert all(float(r["value"][1]) == 0 for r in shares), shares

        _eventually(gateway_series, timeout=30)
