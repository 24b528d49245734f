"""The gateway gathers its tables' changes for ``state_flush_ms`` and writes each key once; the
offsets of the batches behind them are acknowledged only after that write is delivered."""

from __future__ import annotations

import asyncio
import collections
import time
from types import SimpleNamespace

import pytest

from pipeline.config import Settings
from pipeline.gateway import app as gateway_app
from pipeline.gateway.app import Gateway
from pipeline.models import Priority, Request
from pipeline.serde import Codec


class InstantProducer:
    """librdkafka's producer as the gateway uses it, every output delivered at once."""

    def __init__(self, config):
        self.linger_ms = config.get("linger.ms")
        self.sent = []

    def produce(self, topic, value, key=None, headers=None, on_delivery=None, partition=None):
        self.sent.append((topic, key))
        on_delivery(None, None)

    def poll(self, timeout=0):
        time.sleep(timeout)  # as librdkafka waits for events: the delivery thread must not spin
        return 0

    def flush(self, timeout=0):
        return 0


class FakeAcks:
    acked = False

    def ack(self):
        self.acked = True


@pytest.fixture
def make_gateway(tmp_path, monkeypatch):
    made = []

    def make(**gateway_settings):
        monkeypatch.setattr(gateway_app, "Producer", InstantProducer)
        settings = Settings.load(env={})
        for key, value in gateway_settings.items():
            setattr(settings.gateway, key, value)
        gateway = Gateway(settings, app_id=f"unit-gw-{tmp_path.name}", web_port=0, datadir=str(tmp_path / "gw"))
        gateway._depth_loaded = True  # nothing to recover
        made.append(gateway)
        return gateway, settings

    yield make
    for gateway in made:
        gateway._deliveries.close(1)  # stops its delivery thread


def _records(settings, tenants, first_offset=0, priority=Priority.NORMAL):
    codec = Codec.default()
    topic = settings.topics.request_topic(priority)
    out = []
    for i, tenant in enumerate(tenants):
        req = Request.new(tenant, "hello", priority=priority, timeout_ms=600_000, max_tokens=4)
        out.append(SimpleNamespace(topic=topic, partition=0, offset=first_offset + i, key=tenant.encode(),
                                   headers=[], value=codec.encode_request(req, settings.serde.wire_format, topic)))
    return out


def test_changes_of_several_batches_are_written_once_per_key_and_only_then_acknowledged(make_gateway):
    gateway, settings = make_gateway(state_flush_ms=60_000)
    first, second = FakeAcks(), FakeAcks()

    async def run():
        gateway._admit_events(_records(settings, ["acme", "acme", "zeta"]), first)
        gateway._admit_events(_records(settings, ["acme"], first_offset=3), second)
        dispatched = [t for t, _ in gateway.out.sent if t == settings.topics.dispatch_topic(Priority.NORMAL)]
        assert len(dispatched) == 4  # outputs go out at once
        assert gateway.bulk_out.sent == []  # the table changes wait for the period's end
        assert not first.acked and not second.acked
        assert gateway._admitted.get("acme\x1fNORMAL") == 3  # the period's own view
        gateway._end_period()

    asyncio.run(run())
    assert first.acked and second.acked
    writes = collections.Counter(gateway.bulk_out.sent)
    assert writes and all(n == 1 for n in writes.values())  # each key once
    assert gateway._admitted.direct.get("acme\x1fNORMAL") == 3 and gateway._admitted.direct.get("zeta\x1fNORMAL") == 1


def test_the_period_ends_on_its_timer_when_nothing_more_arrives(make_gateway):
    gateway, settings = make_gateway(state_flush_ms=20)
    acks = FakeAcks()

    async def run():
        gateway._admit_events(_records(settings, ["acme"]), acks)
        assert not acks.acked
        await asyncio.sleep(0.1)

    asyncio.run(run())
    assert acks.acked and gateway.bulk_out.sent


def test_with_state_flush_ms_zero_every_batch_is_written_and_acknowledged_at_once(make_gateway):
    gateway, settings = make_gateway(state_flush_ms=0)
    acks = FakeAcks()

    async def run():
        gateway._admit_events(_records(settings, ["acme"]), acks)

    asyncio.run(run())
    assert acks.acked and gateway.bulk_out.sent


def test_background_dispatches_take_the_bulk_producer_and_the_other_bands_the_urgent_one(make_gateway):
    gateway, settings = make_gateway(state_flush_ms=60_000, high_load=10.0)
    assert gateway.out.linger_ms == settings.gateway.producer_linger_ms
    assert gateway.bulk_out.linger_ms == settings.gateway.bulk_linger_ms

    async def run():
        for i, band in enumerate((Priority.CRITICAL, Priority.LOW, Priority.BACKGROUND)):
            gateway._admit_events(_records(settings, ["acme"], first_offset=i, priority=band), FakeAcks())

    asyncio.run(run())
    urgent = {t for t, _ in gateway.out.sent}
    bulk = {t for t, _ in gateway.bulk_out.sent}
    assert {settings.topics.dispatch_topic(Priority.CRITICAL), settings.topics.dispatch_topic(Priority.LOW)} <= urgent
    assert settings.topics.dispatch_topic(Priority.BACKGROUND) in bulk
    assert settings.topics.dispatch_topic(Priority.BACKGROUND) not in urgent


def test_the_group_session_and_static_membership_reach_faust(make_gateway):
    # Faust's own session timeout (60 s) is how long a crashed gateway's partitions would wait.
    gateway, settings = make_gateway(session_timeout_ms=8_000, instance_id="gateway-0")
    conf = gateway.app.conf
    assert conf.broker_session_timeout == 8.0
    assert conf.broker_heartbeat_interval <= conf.broker_session_timeout / 3
    assert conf.consumer_group_instance_id == "gateway-0"


def test_without_an_instance_id_the_gateway_is_a_dynamic_member(make_gateway):
    gateway, settings = make_gateway()
    assert gateway.app.conf.consumer_group_instance_id is None
    assert gateway.app.conf.broker_session_timeout == settings.gateway.session_timeout_ms / 1000


def test_a_refused_dispatch_stops_the_gateway_once_without_waiting_for_another_batch(make_gateway, monkeypatch):
    gateway, settings = make_gateway(state_flush_ms=0)
    crashes = []

    async def crash(exc):
        crashes.append(str(exc))

    monkeypatch.setattr(gateway.app, "crash", crash)

    def refuse(topic, value, key=None, headers=None, on_delivery=None, partition=None):
        on_delivery("MSG_SIZE_TOO_LARGE", SimpleNamespace(topic=lambda: topic))

    async def run():
        gateway.out.produce = refuse
        acks = FakeAcks()
        gateway._admit_events(_records(settings, ["acme", "zeta"]), acks)
        await asyncio.sleep(0.05)
        assert not acks.acked  # never committed past: a restart admits these again
        assert len(crashes) == 1 and "gateway outputs not delivered" in crashes[0]
        with pytest.raises(Exception, match="not delivered"):
            gateway._admit_events(_records(settings, ["acme"], first_offset=2), FakeAcks())
        await asyncio.sleep(0.05)
        assert len(crashes) == 1

    asyncio.run(run())


def test_a_resubmitted_id_is_answered_once_within_the_dedupe_horizon_and_forgotten_after_it(make_gateway,
                                                                                            monkeypatch):
    gateway, settings = make_gateway(dedupe_horizon_ms=10_000)  # ids are kept 10 s (two 5-s windows)
    codec, topic = Codec.default(), settings.topics.request_topic(Priority.NORMAL)
    dispatch = settings.topics.dispatch_topic(Priority.NORMAL)
    now = [int(time.time() * 1000)]
    monkeypatch.setattr(gateway_app, "_now_ms", lambda: now[0])
    once = Request.new("acme", "hello", priority=Priority.NORMAL, timeout_ms=600_000, max_tokens=4)
    other = Request.new("acme", "hello", priority=Priority.NORMAL, timeout_ms=600_000, max_tokens=4)
    offsets = iter(range(100))

    def submit(req, at_ms):
        now[0] = at_ms
        value = codec.encode_request(req, settings.serde.wire_format, topic)
        gateway._admit_events([SimpleNamespace(topic=topic, partition=0, offset=next(offsets), key=b"acme",
                                               headers=[], value=value)], FakeAcks())
        return sum(1 for t, _ in gateway.out.sent if t == dispatch)

    async def run():
        start = now[0]
        assert submit(once, start) == 1
        assert submit(once, start + 1_000) == 1  # the same id again: answered already
        assert submit(other, start + 11_000) == 2  # past the horizon: the first id is forgotten here
        assert once.request_id not in gateway._seen and other.request_id in gateway._seen
        assert submit(once, start + 11_500) == 3
        assert submit(once, start + 12_000) == 3  # and remembered again from its new admission
        assert [rid for _, rid in gateway._seen_order] == [other.request_id, once.request_id]

    asyncio.run(run())
