"""A request the gateway fails on (a bug, not bad bytes) is dead-lettered with the reason, and
the rest of its batch is admitted."""

import asyncio
import time
from types import SimpleNamespace

from pipeline.config import Settings
from pipeline.dlq import H_REASON
from pipeline.gateway import app as gateway_app
from pipeline.gateway.app import Gateway


def fake_record(offset):
    """What the intake hands the gateway: aiokafka's ConsumerRecord (these attributes)."""
    return SimpleNamespace(topic="llm.requests.normal", partition=0, offset=offset, headers=[],
                           value=b"\xc3\x01request", key=b"tenant")


class FakeAcks:
    def __init__(self):
        self.acked = False

    def ack(self):
        self.acked = True


class NoProducer:
    """Stands in for librdkafka's producer: outputs are recorded by the test instead."""

    def __init__(self, config):
        pass

    def poll(self, timeout=0):
        time.sleep(timeout)  # the delivery thread waits here, as on librdkafka's events
        return 0

    def flush(self, timeout=0):
        return 0


def test_a_failing_request_is_dead_lettered_and_the_batch_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(gateway_app, "Producer", NoProducer)
    settings = Settings.load(env={})
    gateway = Gateway(settings, app_id="unit-gw", web_port=0, datadir=str(tmp_path / "gw"))
    produced, admitted = [], []

    def admit_one(msg, seen_new):
        if msg.offset == 1:
            raise KeyError("a bug")
        admitted.append(msg.offset)

    gateway._admit_one = admit_one
    gateway._produce = lambda topic, value, key, headers=None: produced.append((topic, value, dict(headers or [])))
    records, acks = [fake_record(i) for i in range(3)], FakeAcks()

    async def run():
        gateway._admit_events(records, acks)
        assert not acks.acked  # not before the period's table changes are written
        gateway._end_period()
        gateway._deliveries.close(1)

    asyncio.run(run())
    assert admitted == [0, 2]
    [(topic, value, headers)] = produced
    assert topic == settings.topics.dlq and value == records[1].value
    assert headers[H_REASON] == b"gateway_error"
    assert acks.acked  # nothing left unacknowledged: the dead letter is the answer
