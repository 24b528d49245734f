"""`llmq broker up/status/down` and `llmq topics create` as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.broker import LocalBroker
from pipeline.topics import create_pipeline_topics, ensure_topics, pipeline_topics
from tests.integration.harness import free_port, make_settings

pytestmark = pytest.mark.integration


def llmq(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=180)


def _java_pids_for(data_dir: Path) -> list[int]:
    return LocalBroker(1, data_dir).stray_pids()


def test_broker_up_status_down_lifecycle_leaves_no_java_process(tmp_path):
    port, data = str(free_port()), str(tmp_path / "kafka")
    down_first = llmq("broker", "status", "--port", port, "--data-dir", data)
    assert down_first.returncode == 1, down_first.stdout
    assert "not running" in down_first.stdout

    up = llmq("broker", "up", "--port", port, "--data-dir", data)
    assert up.returncode == 0, up.stderr
    assert f"127.0.0.1:{port}" in up.stdout
    try:
        again = llmq("broker", "up", "--port", port, "--data-dir", data)  # idempotent
        assert again.returncode == 0, again.stderr
        assert "formatting" not in again.stderr

        status = llmq("broker", "status", "--port", port, "--data-dir", data)
        assert status.returncode == 0
        assert "answering" in status.stdout
        log_line = next(line for line in status.stdout.splitlines() if "log file:" in line)
        assert Path(log_line.split("log file:")[1].strip()).is_file()
        # --json, with the global option after the command
        as_json = llmq("broker", "status", "--json", "--port", port, "--data-dir", data, "--log-level", "warning")
        assert as_json.returncode == 0, as_json.stderr
        doc = json.loads(as_json.stdout)
        assert doc["state"] == "answering" and doc["answering"] is True and doc["secure"] is False
        assert doc["bootstrap"] == f"127.0.0.1:{port}" and isinstance(doc["pid"], int)
        assert Path(doc["log_file"]).is_file()
        assert len(_java_pids_for(Path(data).resolve())) == 1
    finally:
        down = llmq("broker", "down", "--port", port, "--data-dir", data)
    assert down.returncode == 0, down.stderr
    assert "stopped" in down.stdout
    assert _java_pids_for(Path(data).resolve()) == []
    after = llmq("broker", "status", "--port", port, "--data-dir", data)
    assert after.returncode == 1


def test_topics_create_is_idempotent_and_reports_partition_mismatch(bootstrap):
    settings = make_settings(bootstrap)
    env = {"LLMQ_BOOTSTRAP": bootstrap, "LLMQ_TOPICS__PREFIX": settings.topics.prefix,
           "LLMQ_TOPICS__REQUEST_PARTITIONS": "2"}
    settings.topics.request_partitions = 2
    count = len(pipeline_topics(settings))
    # Co-partitioned with the request topics: they follow its count.
    follow = {*settings.topics.request_topics, settings.topics.receipts}
    first = llmq("topics", "create", env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("created") == count
    second = llmq("topics", "create", env=env)
    assert second.returncode == 0
    assert second.stdout.count("exists") == count
    mismatch = llmq("topics", "create", env={**env, "LLMQ_TOPICS__REQUEST_PARTITIONS": "4"})
    assert mismatch.returncode == 2
    assert "MISMATCH" in mismatch.stdout and "configured 4 partitions, broker has 2" in mismatch.stdout
    as_json = llmq("topics", "create", "--json", "--bootstrap", bootstrap,
                   env={**env, "LLMQ_TOPICS__REQUEST_PARTITIONS": "4", "LLMQ_BOOTSTRAP": "127.0.0.1:1"})
    assert as_json.returncode == 2, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["ok"] is False and doc["created"] == [] and len(doc["existing"]) == count - len(follow)
    assert {m["topic"] for m in doc["mismatched"]} == follow
    assert all(m["configured_partitions"] == 4 and m["broker_partitions"] == 2 for m in doc["mismatched"])


def test_topics_get_their_configured_retention(bootstrap):
    from confluent_kafka.admin import AdminClient, ConfigResource

    settings = make_settings(bootstrap)
    settings.topics.request_config = {"retention.ms": "3600000"}
    create_pipeline_topics(settings)
    admin = AdminClient(settings.kafka.admin_config())
    res = ConfigResource("topic", settings.topics.request_topics[0])
    configs = admin.describe_configs([res])[res].result()
    assert configs["retention.ms"].value == "3600000"
    # and creating again with the same specs changes nothing
    report = ensure_topics(admin, pipeline_topics(settings))
    assert report.ok and not report.created
