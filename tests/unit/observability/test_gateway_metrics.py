"""GatewayMetrics: the queue gauges mirror GET /v1/queue, the fairness index per band."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from pipeline.models import BANDS
from pipeline.observability.metrics import GatewayMetrics
from pipeline.policy.queues import QueueModel


def _samples(m: GatewayMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _band(name: str, band: str, samples: dict) -> float:
    return samples[(name, (("priority", band),))]


def test_queue_gauges_are_the_snapshot_of_the_queue_model():
    q = QueueModel([10, 20, 0, 0, 0], target_queue_ms=1_000, deep=1)
    # Two readings a second apart: 40 arrived and 20 drained in that second; HIGH holds 30.
    q.observe([0, 10, 0, 0, 0], 100, 100, 0)
    q.observe([0, 30, 0, 0, 0], 140, 120, 1_000)
    snap = q.snapshot()
    m = GatewayMetrics()
    m.observe_queues(snap)
    s = _samples(m)
    for p in BANDS:
        b = snap["bands"][p.value]
        assert _band("llmq_gateway_queue_depth", p.value, s) == b["depth"]
        assert _band("llmq_gateway_queue_cap", p.value, s) == b["cap"]
        assert _band("llmq_gateway_load", p.value, s) == b["load"]
        assert _band("llmq_gateway_eta_seconds", p.value, s) == pytest.approx(b["eta_ms"] / 1000.0)
    assert _band("llmq_gateway_queue_depth", "HIGH", s) == 30
    assert _band("llmq_gateway_queue_cap", "HIGH", s) == 20
    assert _band("llmq_gateway_eta_seconds", "HIGH", s) > 0
    assert _band("llmq_gateway_load", "HIGH", s) > 0
    assert s[("llmq_gateway_drain_rate", ())] == snap["drain_rate_per_s"] > 0
    assert s[("llmq_gateway_arrival_rate", ())] == snap["arrival_rate_per_s"] > snap["drain_rate_per_s"]


def test_eta_is_infinite_when_work_waits_and_nothing_drains():
    q = QueueModel([0] * len(BANDS))
    q.observe([0, 0, 5, 0, 0], 5, 0, 0)
    m = GatewayMetrics()
    m.observe_queues(q.snapshot())
    s = _samples(m)
    assert _band("llmq_gateway_eta_seconds", "NORMAL", s) == math.inf
    assert _band("llmq_gateway_eta_seconds", "CRITICAL", s) == 0.0  # nothing ahead of it


def test_per_band_gauges_need_their_band():
    m = GatewayMetrics()
    for gauge in (m.load, m.depth, m.eta):
        with pytest.raises(ValueError):
            gauge.labels()


def test_capacity_is_exported_and_zero_until_measured():
    m = GatewayMetrics()
    q = QueueModel([0] * len(BANDS))
    m.observe_queues(q.snapshot())
    assert _samples(m)[("llmq_gateway_capacity", ())] == 0.0


def test_fairness_index_per_band_over_the_window():
    m = GatewayMetrics()
    m.refresh(0.0)
    assert not [k for k in _samples(m) if k[0].startswith("llmq_gateway_fairness")]
    for _ in range(10):
        m.observe_fairness("HIGH", "acme", True)
        m.observe_fairness("HIGH", "globex", False, "rate_limited: limit per_second: 20 requests")
        m.observe_fairness("LOW", "acme", True)
    # An invalid request asked for nothing the gateway could give: no demand, no unfairness.
    m.observe_fairness("LOW", "initech", False, "invalid_request: prompt is empty")
    m.refresh(1.0)
    s = _samples(m)
    assert _band("llmq_gateway_fairness_jain", "HIGH", s) == pytest.approx(0.5)  # one of two tenants served
    assert _band("llmq_gateway_fairness_tenants", "HIGH", s) == 2
    assert _band("llmq_gateway_fairness_jain", "LOW", s) == 1.0
    assert _band("llmq_gateway_fairness_tenants", "LOW", s) == 1
    # A minute without decisions: no demand, no index.
    m.refresh(1.0 + m.FAIRNESS_WINDOW_S)
    assert not [k for k in _samples(m) if k[0].startswith("llmq_gateway_fairness")]
