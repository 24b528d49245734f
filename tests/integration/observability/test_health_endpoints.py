"""/healthz and /readyz of a worker (beside /metrics) and of the lag exporter, run as deployed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.harness import free_port

pytestmark = pytest.mark.integration


def _get(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            body = r.read()
            return r.status, json.loads(body) if url.endswith("z") else body.decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


def _wait_ok(url: str, proc: subprocess.Popen, log, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        code, doc = _get(url)
        if code == 200:
            return doc
        assert proc.poll() is None and time.monotonic() < deadline, (code, doc, log.read_text()[-3000:])
        time.sleep(0.3)


def _run(settings, tmp_path, name: str, *args: str) -> tuple[subprocess.Popen, object]:
    log = tmp_path / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "--log-level", "INFO", *args],
                                env={**os.environ, **settings.topology_env()}, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=tmp_path)
    return proc, log


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_worker_answers_healthz_and_readyz_beside_metrics(settings, tmp_path):
    port = free_port()
    proc, log = _run(settings, tmp_path, "worker", "worker", "--metrics-port", str(port), "--sim-latency-ms", "5")
    try:
        base = f"http://127.0.0.1:{port}"
        doc = _wait_ok(f"{base}/healthz", proc, log)
        assert doc["status"] == "ok" and {"loop", "session", "producer"} <= set(doc["checks"])
        doc = _wait_ok(f"{base}/readyz", proc, log)
        assert doc["status"] == "ok" and "consuming" in doc["checks"]
        code, text = _get(f"{base}/metrics")
        assert code == 200 and "llmq_worker_up" in text and "llmq_health_stalls_total" in text
    finally:
        _stop(proc)


def test_lag_exporter_answers_healthz_and_readyz(settings, tmp_path):
    port = free_port()
    proc, log = _run(settings, tmp_path, "lag", "lag-exporter", "--metrics-port", str(port), "--interval", "1")
    try:
        base = f"http://127.0.0.1:{port}"
        assert _wait_ok(f"{base}/healthz", proc, log)["status"] == "ok"
        assert _wait_ok(f"{base}/readyz", proc, log)["checks"] == ["refresh", "snapshot"]
        code, text = _get(f"{base}/metrics")
        assert code == 200 and "kafka_" in text
    finally:
        _stop(proc)
