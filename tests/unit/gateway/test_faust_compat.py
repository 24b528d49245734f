"""The fetch-wait shim (pipeline/gateway/faust_compat.py, robinhood/faust#281)."""

import asyncio

import faust
import pytest
from faust import transport

from pipeline.gateway import faust_compat


def test_the_installed_faust_and_aiokafka_are_the_ones_the_shim_was_written_for():
    # Fails on purpose when the pin moves: read the new faust-streaming's
    # AIOKafkaConsumerThread._create_worker_consumer and aiokafka's AIOKafkaConsumer.start()
    # again. Drop the shim if the wait became a Faust setting; otherwise update WRITTEN_FOR.
    assert faust_compat.installed_versions() == faust_compat.WRITTEN_FOR, faust_compat.UPSTREAM_ISSUE


def test_the_llmq_scheme_is_the_shimmed_transport_through_fausts_entry_point():
    assert faust_compat.broker_scheme() == "llmq"
    assert transport.by_url("llmq://127.0.0.1:9092") is faust_compat.Transport


@pytest.mark.parametrize("wait_ms, min_bytes", [(5, 1), (250, 65536)])
def test_the_gateways_consumer_gets_the_configured_fetch_wait_and_minimum(wait_ms, min_bytes):
    async def build():
        app = faust.App("fetch-wait-test", broker="llmq://127.0.0.1:9092", store="memory://",
                        autodiscover=False, web_enabled=False)
        thread = app.consumer._thread
        consumer = thread._create_worker_consumer(app.transport)
        return type(thread), consumer._fetch_max_wait_ms, consumer._fetch_min_bytes

    faust_compat.set_fetch_wait(wait_ms, min_bytes)
    try:
        thread_type, got_wait, got_min = asyncio.run(build())
    finally:
        faust_compat.set_fetch_wait(10)
    assert thread_type is faust_compat.ConsumerThread
    assert (got_wait, got_min) == (wait_ms, min_bytes)


def test_on_other_versions_the_gateway_runs_on_fausts_own_transport(monkeypatch, caplog):
    monkeypatch.setattr(faust_compat, "installed_versions", lambda: {"faust-streaming": "9.9", "aiokafka": "0.14.0"})
    assert faust_compat.broker_scheme() == "kafka"
    assert "shim off" in caplog.text
