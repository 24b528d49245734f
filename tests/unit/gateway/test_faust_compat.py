"""The faust-streaming shims (pipeline/gateway/faust_compat.py): the fetch wait (robinhood/faust#281)
and the recovery watch."""

import asyncio

import faust
import pytest
from faust import transport
from faust.types import TP

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


# -- the recovery watch -------------------------------------------------------------------------

class _Recovery:
    def __init__(self, offsets: dict, highwaters: dict):
        self.in_recovery = True
        self.active_offsets, self.highwaters = dict(offsets), highwaters

    def active_remaining(self):
        return {tp: hw - self.active_offsets[tp] for tp, hw in self.highwaters.items()}


class _Consumer:
    def __init__(self, positions: dict):
        self.positions = positions
        self.sought: list = []

    async def position(self, tp):
        return self.positions[tp]

    async def seek_wait(self, partitions):
        self.sought.append(dict(partitions))


class _App:
    def __init__(self, recovery, consumer):
        self.tables = type("Tables", (), {"recovery": recovery})()
        self.consumer, self.consumer_generation_id = consumer, 6


def _watch(recovery, consumer):
    now = [0.0]
    watch = faust_compat.RecoveryWatch(_App(recovery, consumer), stall_s=3.0, clock=lambda: now[0])
    return watch, now


def test_a_changelog_partition_whose_records_went_past_recovery_is_sought_back_once_it_stalls():
    tp = TP("gw-seen-changelog", 2)
    recovery, consumer = _Recovery({tp: 95}, {tp: 134}), _Consumer({tp: 135})
    watch, now = _watch(recovery, consumer)
    for at in (0.0, 1.0, 2.9):
        now[0] = at
        asyncio.run(watch.check())
    assert consumer.sought == []  # not stalled long enough yet
    now[0] = 3.1
    asyncio.run(watch.check())
    assert consumer.sought == [{tp: 95}] and watch.sought == 1
    now[0] = 4.0
    asyncio.run(watch.check())
    assert len(consumer.sought) == 1  # waits another stall_s before seeking again


def test_recovery_that_moves_or_a_consumer_not_past_it_is_left_alone():
    moving, behind = TP("gw-seen-changelog", 0), TP("gw-tenants-changelog", 0)
    recovery = _Recovery({moving: 10, behind: 20}, {moving: 50, behind: 28})
    consumer = _Consumer({moving: 50, behind: 21})  # behind: the fetch has not come back yet
    watch, now = _watch(recovery, consumer)
    for step in range(10):
        now[0] = float(step)
        recovery.active_offsets[moving] += 1
        asyncio.run(watch.check())
    assert consumer.sought == []
    recovery.in_recovery = False
    asyncio.run(watch.check())
    assert watch._waiting == {}
