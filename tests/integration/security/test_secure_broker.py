"""The secured local broker (SASL_SSL + SCRAM-SHA-512 + ACLs): every role does its job and no more."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from pipeline import acls
from pipeline.broker import LocalBroker
from pipeline.client import LlmqClient
from pipeline.config import Settings
from pipeline.errors import AuthenticationError, KafkaOperationError
from pipeline.models import Priority, Request, Status
from pipeline.observability.lag import LagReader
from pipeline.topics import create_pipeline_topics
from tests.integration.harness import free_port, running_worker


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory):
    broker = LocalBroker(free_port(), tmp_path_factory.mktemp("secure-kafka"), heap="512m", secure=True,
                         progress=print)
    broker.up()
    try:
        yield broker
    finally:
        broker.down()


@pytest.fixture(scope="module")
def prefix(secure_broker) -> str:
    """Topics created and ACLs applied by the admin principal."""
    prefix = f"s{uuid.uuid4().hex[:8]}.llm"
    admin_settings = settings_for(secure_broker, "admin", prefix)
    create_pipeline_topics(admin_settings)
    acls.apply(AdminClient(admin_settings.kafka.admin_config()), admin_settings)
    return prefix


def settings_for(broker: LocalBroker, role: str, prefix: str) -> Settings:
    s = Settings.load(env=broker.client_env(role))
    s.topics.prefix = prefix
    s.topics.request_partitions = s.topics.response_partitions = 3
    s.worker.commit_interval_ms = 200
    s.worker.shutdown_grace_s = 3
    return s


def test_the_pipeline_runs_end_to_end_over_sasl_ssl_with_one_principal_per_role(secure_broker, prefix, caplog):
    caplog.set_level(logging.INFO, logger="pipeline.worker.membership")
    worker_settings = settings_for(secure_broker, "worker", prefix)
    assert worker_settings.kafka.consumer_config("g")["security.protocol"] == "SASL_SSL"
    with running_worker(worker_settings), LlmqClient(settings_for(secure_broker, "client", prefix)) as client:
        for band in Priority:
            resp = client.submit_and_wait(Request.new("tenant-secure", f"over TLS {band}", priority=band), timeout=60)
            assert resp.status is Status.COMPLETED, resp.reason
    # The worker principal may set its group's session (consumer group protocol).
    assert "could not set group" not in caplog.text
    assert f"group {worker_settings.worker.group_id}: consumer.session.timeout.ms=" in caplog.text


def test_the_lag_exporter_describes_groups_without_reading_topics(secure_broker, prefix):
    reader = LagReader(settings_for(secure_broker, "lagexporter", prefix), group_pattern="^llmq-workers$")
    snap = reader.snapshot()
    assert "llmq-workers" in snap.groups
    assert all(p.lag >= 0 for p in snap.partitions)


def test_a_producer_cannot_read_responses(secure_broker, prefix):
    with pytest.raises(KafkaOperationError, match="not authorized"):
        LlmqClient(settings_for(secure_broker, "producer", prefix))
    consumer = Consumer({**secure_broker.client_config("producer"), "bootstrap.servers": secure_broker.bootstrap,
                         "group.id": "llmq-snoop", "enable.auto.commit": False})
    codes, data = set(), []
    try:
        consumer.assign([TopicPartition(f"{prefix}.responses", 0, 0)])
        for _ in range(6):
            for m in consumer.consume(10, 0.5):
                (data.append(m) if m.error() is None else codes.add(m.error().code()))
    finally:
        consumer.close()
    # A raw Kafka consumer is refused too (first at its group, then the topic), and reads nothing.
    assert not data
    assert codes and codes <= {KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED}, codes


def test_a_worker_cannot_write_request_topics(secure_broker, prefix):
    failures = []
    producer = Producer({**secure_broker.client_config("worker"), "bootstrap.servers": secure_broker.bootstrap})
    producer.produce(f"{prefix}.requests.critical", b"forged", on_delivery=lambda err, msg: failures.append(err))
    producer.flush(15)
    assert failures and failures[0] is not None
    assert failures[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


def test_a_client_cannot_write_responses_or_dispatch(secure_broker, prefix):
    failures = []
    producer = Producer({**secure_broker.client_config("client"), "bootstrap.servers": secure_broker.bootstrap})
    producer.produce(f"{prefix}.responses", b"forged answer", on_delivery=lambda err, msg: failures.append(err))
    producer.flush(15)
    assert failures[0] is not None and failures[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


def test_a_wrong_password_is_refused_with_a_clear_error(secure_broker, prefix, tmp_path):
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password")
    settings = settings_for(secure_broker, "client", prefix)
    settings.kafka.sasl_password_file = str(wrong)
    with pytest.raises(AuthenticationError, match="refused the credentials of 'client'"):
        LlmqClient(settings)


def test_no_secret_reaches_the_logs_at_debug_level(secure_broker, prefix):
    env = {**os.environ, **secure_broker.client_env("client"), "LLMQ_TOPICS__PREFIX": prefix,
           # librdkafka's own debug output too
           "LLMQ_RDKAFKA_DEBUG": "security,broker,conf"}
    run = subprocess.run([sys.executable, "-m", "pipeline.cli", "--log-level", "DEBUG", "submit", "--tenant", "t",
                          "--no-wait", "hello"], capture_output=True, text=True, env=env, timeout=120)
    logs = run.stdout + run.stderr
    assert run.returncode == 0, logs[-2000:]
    assert "sasl" in logs.lower()  # the debug output really ran
    for role in ("client", "admin"):
        secret = (secure_broker.secrets_dir / f"{role}.password").read_text().strip()
        assert secret not in logs
    status = subprocess.run([sys.executable, "-m", "pipeline.cli", "--log-level", "DEBUG", "broker", "status",
                             "--port", str(secure_broker.port), "--data-dir", str(secure_broker.data_dir)],
                            capture_output=True, text=True, timeout=60)
    assert (secure_broker.secrets_dir / "admin.password").read_text().strip() not in status.stdout + status.stderr


def test_a_producer_submits_requests(secure_broker, prefix):
    with LlmqClient(settings_for(secure_broker, "producer", prefix), listen=False) as client:
        sub = client.submit(Request.new("tenant-p", "fire and forget", priority=Priority.LOW), track=False)
    assert sub.topic == f"{prefix}.requests.low"


def test_the_gateway_role_reads_requests_in_its_group_and_writes_dispatch(secure_broker, prefix):
    dispatch = f"{prefix}.dispatch.high"  # created with the pipeline's topics
    gw = {**secure_broker.client_config("gateway"), "bootstrap.servers": secure_broker.bootstrap}
    failures = []
    producer = Producer({**gw, "enable.idempotence": True})
    producer.produce(dispatch, b"admitted", on_delivery=lambda err, msg: failures.append(err))
    producer.flush(15)
    assert failures == [None]
    with LlmqClient(settings_for(secure_broker, "producer", prefix), listen=False) as client:
        client.submit(Request.new("tenant-g", "for the gateway", priority=Priority.LOW), track=False)
    consumer = Consumer({**gw, "group.id": "llmq-gateway", "auto.offset.reset": "earliest"})
    msgs = []
    try:
        consumer.subscribe([f"{prefix}.requests.low"])
        for _ in range(40):
            msgs += [m for m in consumer.consume(10, 0.5) if m.error() is None]
            if msgs:
                break
        assert msgs, "the gateway role read nothing from the request topic"
        consumer.commit(message=msgs[-1], asynchronous=False)  # its own group: allowed
    finally:
        consumer.close()
    denied = []
    producer.produce(f"{prefix}.requests.high", b"forged", on_delivery=lambda err, msg: denied.append(err))
    producer.flush(15)
    assert denied[0] is not None and denied[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
