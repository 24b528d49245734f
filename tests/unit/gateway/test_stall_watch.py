"""The gateway's stall watch against a stand-in for Faust's consumer: seek once, then give up."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from faust.types import TP

from pipeline.gateway.stall_watch import StallWatch
from pipeline.observability.health import Events
from pipeline.observability.metrics import GatewayMetrics


class FakeConsumer:
    def __init__(self, positions):
        self.positions = positions
        self.sought = []

    def assignment(self):
        return {TP(t, p) for t, p in self.positions} | {TP("gw-tenants-changelog", 0)}

    async def position(self, tp):
        return self.positions[(tp.topic, tp.partition)]

    async def seek_wait(self, partitions):
        self.sought.append(dict(partitions))


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def make(positions, stall_s=5.0):
    clock = Clock()
    consumer = FakeConsumer(positions)
    app = SimpleNamespace(consumer=consumer, rebalancing=False,
                          tables=SimpleNamespace(recovery=SimpleNamespace(in_recovery=False)))
    metrics = GatewayMetrics()
    gave_up = []
    watch = StallWatch(app, {"req"}, stall_s, None, Events(metrics.health_recoveries, metrics.health_stalls),
                       give_up=gave_up.append, clock=clock)
    return watch, consumer, clock, metrics, gave_up


def test_a_partition_whose_position_stands_behind_its_end_is_sought_then_given_up():
    watch, consumer, clock, metrics, gave_up = make({("req", 0): 10, ("req", 1): 4})
    run = asyncio.run
    watch.ended({("req", 0): 10, ("req", 1): 9})
    run(watch.check())
    clock.now = 4.0
    run(watch.check())
    assert watch.reason() is None and not consumer.sought
    clock.now = 5.5
    assert "req[1] (5 waiting" in watch.reason()
    run(watch.check())
    assert consumer.sought == [{TP("req", 1): 4}]
    assert metrics.health_recoveries.children[("fetch_stalled",)].value == 1
    clock.now = 11.0
    run(watch.check())
    assert gave_up and "req[1]" in gave_up[0]
    assert metrics.health_stalls.children[("fetch_stalled",)].value == 1
    run(watch.check())
    assert len(gave_up) == 1  # once


def test_events_or_a_moving_position_are_progress():
    watch, consumer, clock, metrics, gave_up = make({("req", 0): 0})
    run = asyncio.run
    watch.ended({("req", 0): 100})
    run(watch.check())
    for step in range(1, 8):
        clock.now = step * 3.0
        if step % 2:
            watch.consumed("req", 0)  # an agent took an event (Faust's buffers full: the position stands)
        else:
            consumer.positions[("req", 0)] += 10
        run(watch.check())
    assert watch.reason() is None and not consumer.sought and not gave_up


def test_no_stall_while_faust_recovers_or_rebalances():
    watch, consumer, clock, metrics, gave_up = make({("req", 0): 0})
    watch.app.tables.recovery.in_recovery = True
    watch.ended({("req", 0): 100})
    for step in range(5):
        clock.now = step * 5.0
        asyncio.run(watch.check())
    assert watch.reason() is None and not consumer.sought


def test_a_rebalance_that_never_ends_is_not_live():
    from pipeline.gateway.stall_watch import REBALANCE_S

    watch, consumer, clock, metrics, gave_up = make({("req", 0): 0})
    watch.app.rebalancing = True
    asyncio.run(watch.check())
    clock.now = REBALANCE_S
    asyncio.run(watch.check())
    assert watch.reason() is None and not gave_up
    clock.now = REBALANCE_S + 6.0
    asyncio.run(watch.check())
    assert "rebalance has not ended" in watch.reason() and gave_up
    assert metrics.health_stalls.children[("rebalance_hung",)].value == 1
