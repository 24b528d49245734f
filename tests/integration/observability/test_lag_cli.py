"""`llmq lag` as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from confluent_kafka import Consumer, Producer, TopicPartition

from pipeline.models import Priority


def test_llmq_lag_json_and_table_show_per_partition_and_per_band_lag(settings):
    bootstrap = settings.kafka.bootstrap
    topic = settings.topics.request_topic(Priority.NORMAL)
    group = f"llmq-{settings.topics.prefix}-cli"
    producer = Producer({"bootstrap.servers": bootstrap})
    for _ in range(5):
        producer.produce(topic, b"x", partition=1)
    producer.flush(10)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    consumer.commit(offsets=[TopicPartition(topic, 1, 2)], asynchronous=False)
    consumer.close()

    env = {**os.environ, "LLMQ_BOOTSTRAP": bootstrap, "LLMQ_TOPICS__PREFIX": settings.topics.prefix}
    run = lambda *a: subprocess.run([sys.executable, "-m", "pipeline.cli", "lag", "--groups", f"^{group}$",  # noqa: E731
                                     "--sample", "0.5", *a], capture_output=True, text=True, env=env, timeout=60)
    out = run("--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    (part,) = [p for p in doc["partitions"] if p["topic"] == topic and p["partition"] == 1]
    assert (part["committed"], part["end"], part["lag"]) == (2, 5, 3)
    assert doc["bands"]["NORMAL"]["depth"] == 3
    assert doc["groups"][group]["members"] == 0
    table = run()
    assert table.returncode == 0
    assert "PRIORITY" in table.stdout and topic in table.stdout
