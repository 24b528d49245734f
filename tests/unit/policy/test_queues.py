"""Bounded queues: depths and rates from the dispatch topics, position, ETA, retry-after, load."""

from __future__ import annotations

import pytest

from pipeline.models import Priority
from pipeline.policy.queues import QueueModel, Rate

NORMAL = Priority.NORMAL.rank
T0 = 1_800_000_000_000


def observed(q: QueueModel, per_s: float, depths=(0, 0, 0, 0, 0), seconds: int = 10, start: float = T0) -> float:
    """Readings every 0.5 s of a steady drain (and as many arrivals) with ``depths`` queued."""
    at = start
    for i in range(seconds * 2 + 1):
        at = start + i * 500
        total = int(per_s * (at - T0) / 1000)
        q.observe(list(depths), total + sum(depths), total, at)
    return at


def test_a_rate_follows_its_running_total_and_forgets_the_past():
    r = Rate(tau_ms=1_000)
    for i in range(21):
        r.observe(100 * i, T0 + i * 500)  # 200/s
    assert r.per_s == pytest.approx(200, rel=0.01)
    for i in range(21, 41):
        r.observe(100 * 20 + 5 * (i - 20), T0 + i * 500)  # 10/s
    assert r.per_s == pytest.approx(10, rel=0.05)


def test_totals_that_go_backwards_start_the_rate_over():
    r = Rate()
    r.observe(1_000, T0)
    r.observe(0, T0 + 500)  # the topics were recreated
    r.observe(100, T0 + 1_000)
    assert r.per_s > 0


def test_position_counts_this_band_and_every_higher_one_and_what_was_admitted_here():
    q = QueueModel([0] * 5)
    q.observe([2, 1, 3, 0, 9], 15, 0, T0)
    q.admitted(NORMAL)
    v = q.check(NORMAL)
    assert not v.full and v.position == 2 + 1 + 4 + 1
    q.observe([0, 0, 0, 0, 9], 16, 7, T0 + 500)  # a reading replaces what was admitted since the last one
    assert q.check(NORMAL).position == 1


def test_eta_from_the_drain_rate():
    q = QueueModel([0] * 5, commit_lag_ms=0)
    observed(q, 100, depths=(0, 0, 50, 0, 0))
    assert q.eta_ms(NORMAL) == pytest.approx(500, rel=0.05)
    assert q.eta_ms(Priority.CRITICAL.rank) == 0


def test_a_full_band_is_refused_with_retry_after_from_its_drain_rate():
    q = QueueModel([0, 0, 100, 0, 0])
    observed(q, 50, depths=(0, 0, 110, 0, 0))
    v = q.check(NORMAL)
    assert v.full and v.retry_after_ms == pytest.approx(11 * 1000 / 50, rel=0.05)


def test_without_any_drain_measured_retry_after_is_the_maximum_and_eta_unknown():
    q = QueueModel([0, 0, 1, 0, 0], max_retry_ms=60_000)
    q.observe([0, 0, 1, 0, 0], 1, 0, T0)
    v = q.check(NORMAL)
    assert v.full and v.retry_after_ms == 60_000 and v.eta_ms == float("inf")


def test_load_is_how_long_a_band_waits_over_the_target():
    q = QueueModel([0] * 5, target_queue_ms=2_000)
    at = observed(q, 100)
    assert q.load(NORMAL) == 0
    q.waited(NORMAL, 3_000, at)
    assert q.load(NORMAL) == pytest.approx(1.5)
    assert q.load(Priority.HIGH.rank) == 0  # another band's wait is not this band's


def test_a_deep_queue_counts_by_its_drain_time_and_a_shallow_one_does_not():
    q = QueueModel([0] * 5, target_queue_ms=2_000, deep=100)
    observed(q, 1, depths=(0, 0, 10, 0, 0))  # ten in flight at a trickle: no load
    assert q.load(NORMAL) == 0
    observed(q, 10, depths=(0, 0, 300, 0, 0), start=T0 + 20_000)  # 30 s of work at 10/s
    assert q.load(NORMAL) == pytest.approx(10.0)


def test_workers_slowing_down_raise_the_load_at_once():
    q = QueueModel([0] * 5, target_queue_ms=2_000, deep=100)
    at = observed(q, 90, depths=(0, 0, 120, 0, 0))
    assert q.load(NORMAL) < 1
    at = observed(q, 4.5, depths=(0, 0, 300, 0, 0), seconds=10, start=at + 500)
    assert q.load(NORMAL) > 1


def test_a_backlog_that_does_not_drain_is_overload():
    q = QueueModel([0] * 5)
    for i in range(6):
        q.observe([0, 0, 500, 0, 0], 500 + i, 0, T0 + i * 500)
    assert q.load(NORMAL) == 10.0
