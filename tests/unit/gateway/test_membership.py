"""The gateway's session: what it asks for, moved into the broker's bounds, and said when moved."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from types import SimpleNamespace

from confluent_kafka import KafkaException

from pipeline.gateway.membership import (KAFKA_DEFAULT_BOUNDS_MS, SessionBounds, broker_session_bounds,
                                         choose_session_ms, heartbeat_ms)


class Admin:
    def __init__(self, configs=None, fail=False):
        self.configs, self.fail = configs or {}, fail

    def list_topics(self, timeout=None):
        return SimpleNamespace(brokers={3: object(), 1: object()})

    def describe_configs(self, resources, request_timeout=None):
        (resource,) = resources
        assert resource.name == "1"  # any broker answers for the cluster's defaults
        fut = Future()
        if self.fail:
            fut.set_exception(KafkaException("CLUSTER_AUTHORIZATION_FAILED"))
        else:
            fut.set_result({k: SimpleNamespace(value=v) for k, v in self.configs.items()})
        return {resource: fut}


def test_a_session_the_broker_allows_is_kept_and_nothing_is_said(caplog):
    bounds = broker_session_bounds(Admin({"group.min.session.timeout.ms": "1000",
                                          "group.max.session.timeout.ms": "300000"}))
    assert bounds == SessionBounds(low_ms=1000, high_ms=300000)
    with caplog.at_level(logging.WARNING):
        assert choose_session_ms(3000, bounds) == 3000
    assert not caplog.records


def test_a_session_below_the_brokers_minimum_is_raised_to_it_and_the_cost_said(caplog):
    with caplog.at_level(logging.WARNING):
        assert choose_session_ms(3000, broker_session_bounds(Admin({"group.min.session.timeout.ms": "6000"}))) == 6000
    assert "joining with 6000 ms" in caplog.text and "group.min/max.session.timeout.ms" in caplog.text
    assert choose_session_ms(3_600_000, SessionBounds(6000, 1_800_000)) == 1_800_000


def test_a_broker_that_will_not_say_is_taken_to_have_kafkas_defaults():
    assert broker_session_bounds(Admin(fail=True)) is None
    assert choose_session_ms(3000, None) == KAFKA_DEFAULT_BOUNDS_MS.low_ms


def test_heartbeats_go_at_a_fifth_of_the_session():
    assert heartbeat_ms(3000) == 600 and heartbeat_ms(1000) == 200
