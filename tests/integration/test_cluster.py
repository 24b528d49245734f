"""`llmq broker up --nodes 3`: a replicated local cluster, as a user runs it, losing a leader."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource

from pipeline.broker import lasting_ports
from pipeline.cluster import LocalCluster

pytestmark = pytest.mark.integration


def llmq(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "LLMQ_BROKER__HEAP": "384m", **(env or {})}, timeout=180)


def test_three_nodes_replicate_topics_and_lose_a_leader_without_losing_a_write(tmp_path):
    port = lasting_ports(3)
    data = str(tmp_path / "cluster")
    up = llmq("broker", "up", "--nodes", "3", "--port", str(port), "--data-dir", data)
    assert up.returncode == 0, up.stderr
    cluster = LocalCluster.at(data)
    try:
        bootstrap = cluster.bootstrap
        assert f"export LLMQ_BOOTSTRAP={bootstrap}" in up.stdout
        assert "export LLMQ_TOPICS__REPLICATION_FACTOR=3" in up.stdout

        status = llmq("broker", "status", "--json", "--data-dir", data, "--log-level", "warning")
        doc = json.loads(status.stdout)
        assert status.returncode == 0 and doc["registered"] == [1, 2, 3]
        assert [n["state"] for n in doc["nodes"]] == ["answering"] * 3

        env = {"LLMQ_BOOTSTRAP": bootstrap, "LLMQ_TOPICS__REPLICATION_FACTOR": "3", "LLMQ_TOPICS__PREFIX": "rf3"}
        created = llmq("topics", "create", env=env)
        assert created.returncode == 0, created.stderr
        admin = AdminClient({"bootstrap.servers": bootstrap})
        topic = "rf3.responses"
        partition = admin.list_topics(topic, timeout=10).topics[topic].partitions[0]
        assert sorted(partition.replicas) == [1, 2, 3]
        config = admin.describe_configs([ConfigResource("topic", topic)])
        assert next(iter(config.values())).result()["min.insync.replicas"].value == "2"

        # acks=all with idempotence while partition 0's leader is SIGKILLed: every write lands once.
        leader = cluster.leader_of(topic, 0)
        producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5})
        failed: list[str] = []
        sent = 3000

        def report(err, msg):
            if err is not None:
                failed.append(err.str())

        killed = threading.Event()

        def kill_leader():
            time.sleep(0.5)
            cluster.signal(leader, signal.SIGKILL)
            killed.set()

        threading.Thread(target=kill_leader, daemon=True).start()
        for i in range(sent):
            producer.produce(topic, str(i).encode(), b"k", partition=0, on_delivery=report)
            producer.poll(0)
            time.sleep(0.0005)
        assert producer.flush(60) == 0 and not failed
        assert killed.is_set()
        new_leader = cluster.leader_of(topic, 0)
        assert new_leader not in (leader, -1)

        seen = _read_all(bootstrap, topic, sent)
        assert sorted(int(v) for v in seen) == list(range(sent))

        cluster.start_node(leader)
        down_status = llmq("broker", "status", "--data-dir", data)
        assert down_status.returncode == 0, down_status.stdout
    finally:
        down = llmq("broker", "down", "--data-dir", data)
    assert down.returncode == 0 and "stopped" in down.stdout
    assert all(not node.stray_pids() for node in LocalCluster.at(data).nodes.values())


def _read_all(bootstrap: str, topic: str, expected: int, timeout: float = 30.0) -> list[bytes]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"rf3-{time.time_ns()}",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    values: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while len(values) < expected and time.monotonic() < deadline:
            values += [m.value() for m in consumer.consume(1000, 0.5) if m.error() is None]
    finally:
        consumer.close()
    return values
