"""The worker's watch on its group coordinator, fed librdkafka statistics as they look."""

from __future__ import annotations

import json

from pipeline.worker.coordinator_watch import CoordinatorWatch


def stats(group: str = "up", coordinator: str = "UP") -> str:
    return json.dumps({"cgrp": {"state": group, "join_state": "steady"},
                       "brokers": {"127.0.0.1:9092/1": {"state": "UP", "nodeid": 1},
                                   "GroupCoordinator": {"state": coordinator, "nodeid": -1}}})


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_coordinator_away_for_the_stall_period_is_a_stall_and_coming_back_clears_it():
    clock = Clock()
    watch = CoordinatorWatch(30.0, clock)
    watch.observe(stats())
    assert watch.stalled_for() is None
    watch.observe(stats(coordinator="TRY_CONNECT"))
    clock.now += 29
    watch.observe(stats(group="wait-coord", coordinator="CONNECT"))
    assert watch.stalled_for() is None  # not yet 30 s
    clock.now += 2
    assert watch.stalled_for() == 31 and "coordinator connection CONNECT" in watch.what
    watch.observe(stats())
    assert watch.stalled_for() is None and watch.what == ""


def test_unreadable_statistics_and_a_consumer_without_a_group_change_nothing():
    clock = Clock()
    watch = CoordinatorWatch(1.0, clock)
    watch.observe("not json")
    watch.observe(json.dumps({"brokers": {}}))
    clock.now += 10
    assert watch.stalled_for() is None


def test_off_at_zero_and_statistics_a_few_times_per_period():
    clock = Clock()
    off = CoordinatorWatch(0.0, clock)
    off.observe(stats(group="wait-coord"))
    clock.now += 1000
    assert off.stalled_for() is None
    assert CoordinatorWatch(30.0).interval_ms() == 7500
    assert CoordinatorWatch(1.0).interval_ms() == 1000
