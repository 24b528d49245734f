"""The workers' capacity as the gateway measures it: busy drain only, kept through idle spells."""

from __future__ import annotations

import pytest

from pipeline.models import Priority
from pipeline.policy.capacity import Capacity
from pipeline.policy.queues import QueueModel

T0 = 1_800_000_000_000
NORMAL = Priority.NORMAL.rank


def feed(c: Capacity, per_s: float, backlog: int, seconds: float, start: float, pipeline: float = 2.0) -> float:
    at = start
    for i in range(1, int(seconds * 2) + 1):
        at = start + i * 500
        c.observe(int(per_s / 2), 500, backlog, pipeline, at)
    return at


def test_the_drain_of_saturated_intervals_is_the_capacity():
    c = Capacity()
    feed(c, 200, backlog=300, seconds=10, start=T0)
    assert c.per_s == pytest.approx(200, rel=0.02)
    assert c.trusted(T0 + 10_000)


def test_an_idle_spell_keeps_the_capacity_and_loses_only_the_evidence():
    c = Capacity()
    at = feed(c, 200, backlog=300, seconds=10, start=T0)
    at = feed(c, 0, backlog=0, seconds=100, start=at)  # a quiet night
    assert c.per_s == pytest.approx(200, rel=0.02)
    assert not c.trusted(at) and c.evidence(at) == 0 and c.fastest(at) == 0


def test_keeping_up_is_a_lower_bound_not_the_capacity():
    c = Capacity()
    at = feed(c, 200, backlog=300, seconds=10, start=T0)
    feed(c, 20, backlog=1, seconds=30, start=at)  # light load: the workers wait for work
    assert c.per_s == pytest.approx(200, rel=0.02)
    fresh = Capacity()
    feed(fresh, 20, backlog=1, seconds=10, start=T0)
    assert fresh.per_s == pytest.approx(20, rel=0.05) and not fresh.trusted(T0 + 10_000)


def test_capacity_lost_under_load_is_seen():
    c = Capacity()
    at = feed(c, 200, backlog=300, seconds=10, start=T0)
    at = feed(c, 20, backlog=600, seconds=20, start=at)  # tenfold slower, work waiting
    assert c.per_s == pytest.approx(20, rel=0.1)
    feed(c, 0, backlog=600, seconds=20, start=at)  # the workers are gone
    assert c.per_s < 1


def test_nothing_measured_is_unknown():
    assert Capacity().per_s is None


def test_a_queue_model_after_idle_gives_a_burst_the_last_capacity_and_no_early_refusal():
    q = QueueModel([0] * 5, commit_lag_ms=0)
    at = T0
    for i in range(21):  # 10 s with 1,000 queued in NORMAL, draining 100/s
        at = T0 + i * 500
        q.observe([0, 0, 1_000, 0, 0], 1_000 + 50 * i, 50 * i, at)
    assert q.eta_floor_ms(NORMAL, at) > 0
    for i in range(1, 21):  # the queue drains at the same pace
        at += 500
        q.observe([0, 0, 1_000 - 50 * i, 0, 0], 2_000, 1_000 + 50 * i, at)
    for i in range(1, 201):  # then 100 s with nothing
        q.observe([0] * 5, 2_000, 2_000, at + i * 500)
    now = at + 100_000
    for _ in range(299):
        q.admitted(NORMAL)
    assert q.eta_ms(NORMAL, now) == pytest.approx(2_990, rel=0.02)  # 299 ahead at 100/s
    assert q.eta_floor_ms(NORMAL, now) == 0  # no recent evidence: nothing refused on it


def test_the_depth_is_projected_by_what_drained_since_the_reading():
    q = QueueModel([0] * 5, commit_lag_ms=0)
    at = T0
    for i in range(21):
        at = T0 + i * 500
        q.observe([0, 0, 1_000, 0, 0], 1_000 + 50 * i, 50 * i, at)
    assert q.eta_ms(NORMAL, at + 2_000) == pytest.approx(q.eta_ms(NORMAL, at) - 2_000, rel=0.02)


def test_intervals_without_a_commit_count_with_the_next_commit():
    # Workers commit every 500 ms, readings every 500 ms out of step: 0, 2, 1, 0, 2 commits...
    c = Capacity()
    at = T0
    for i in range(40):
        at += 500
        commits = (0, 2, 1)[i % 3]
        c.observe(80 * commits, 500, 400, 20, at)  # 80 a commit: 160/s
    assert c.per_s == pytest.approx(160, rel=0.1)


def test_a_lower_band_waits_for_what_the_higher_ones_keep_bringing():
    q = QueueModel([0] * 5, commit_lag_ms=0, min_shares=[0, 0.1, 0.05, 0.05, 0.05])
    for i in range(361):  # 3 min: 100/s drained; NORMAL brings 90/s, LOW holds 50
        q.observe([0, 0, 200, 50, 0], 250 + 50 * i, 50 * i, T0 + i * 500, arrived=[0, 0, 45 * i, 0, 0])
    low = Priority.LOW.rank
    # 250 ahead, at what NORMAL's 90/s leave of 100/s: 25 s, not 2.5.
    assert q.eta_ms(low, T0 + 180_000) == pytest.approx(25_000, rel=0.05)
    assert q.eta_ms(NORMAL, T0 + 180_000) == pytest.approx(2_000, rel=0.05)
