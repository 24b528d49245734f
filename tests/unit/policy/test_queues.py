"""Bounded queues: depth, drain rate, position, ETA and retry-after from measured drain."""

from __future__ import annotations

import pytest

from pipeline.models import Priority
from pipeline.policy.queues import QueueModel, RateMeter

NORMAL = Priority.NORMAL.rank


def test_rate_meter_counts_events_per_second_over_its_window():
    m = RateMeter(window_ms=10_000)
    for t in range(0, 10_000, 10):  # 100 per second for 10 s
        m.add(t)
    assert m.rate(10_000) == pytest.approx(100, rel=0.1)
    assert m.rate(30_000) == 0.0


def test_a_rate_asked_for_again_in_the_same_millisecond_still_counts_what_was_added_in_it():
    m = RateMeter(window_ms=10_000)
    m.add(500)
    first = m.rate(1_000)
    assert first > 0
    m.add(1_000, 9)
    assert m.rate(1_000) == pytest.approx(first * 10)


def test_a_young_meter_is_not_diluted_by_history_it_never_saw():
    m = RateMeter(window_ms=10_000)
    for t in range(0, 2_000, 10):
        m.add(t)
    assert m.rate(2_000) == pytest.approx(100, rel=0.1)


def test_position_counts_this_band_and_every_higher_one():
    q = QueueModel([0] * 5)
    for rank in (0, 1, 2, 3, 4, 2):
        q.admitted(rank, 0)
    assert q.check(NORMAL, 0).position == 4 + 1
    assert q.check(0, 0).position == 2


def test_eta_from_the_drain_rate():
    q = QueueModel([0] * 5)
    for t in range(0, 5_000, 10):  # 100/s admitted and finished
        q.admitted(NORMAL, t)
        q.finished(NORMAL, t)
    for _ in range(50):
        q.admitted(NORMAL, 5_000)
    assert q.eta_ms(NORMAL, 5_000) == pytest.approx(500, rel=0.15)


def test_a_full_band_is_refused_with_retry_after_from_its_drain_rate():
    q = QueueModel([0, 0, 10, 0, 0])
    for t in range(0, 5_000, 10):
        q.admitted(NORMAL, t)
        q.finished(NORMAL, t)
    for _ in range(10):
        q.admitted(NORMAL, 5_000)
    v = q.check(NORMAL, 5_000)
    assert v.full and 5 <= v.retry_after_ms <= 100 + 1  # one slot frees in ~10 ms; floor 100 ms
    assert not q.check(Priority.HIGH.rank, 5_000).full


def test_without_any_drain_measured_retry_after_is_the_maximum_and_eta_unknown():
    q = QueueModel([0, 0, 1, 0, 0], max_retry_ms=30_000)
    q.admitted(NORMAL, 0)
    v = q.check(NORMAL, 0)
    assert v.full and v.retry_after_ms == 30_000 and v.eta_ms == float("inf")


def test_load_is_arrivals_over_the_best_drain_rate_seen():
    q = QueueModel([0] * 5)
    for t in range(0, 5_000, 10):
        q.admitted(NORMAL, t)
        q.finished(NORMAL, t)
    assert q.load(5_000) == pytest.approx(1.0, rel=0.15)
    snap = q.snapshot(5_000)
    assert snap["bands"]["NORMAL"]["depth"] == 0 and snap["drain_rate_per_s"] > 0


def test_a_meter_kept_current_within_its_millisecond_agrees_with_one_recomputed_from_its_counts():
    kept, recomputed = RateMeter(window_ms=3_000), RateMeter(window_ms=3_000)
    for t in (0, 0, 7, 999, 1_000, 1_000, 2_500, 2_500, 2_500, 4_100, 4_100):
        kept.rate(t)  # asked for before each add, as an admission does
        kept.add(t)
        recomputed.add(t)
        recomputed._rate_ms = None  # forget the cache: computed from the counts
        assert kept.rate(t) == recomputed.rate(t)


def test_an_add_in_a_new_bucket_in_the_same_millisecond_as_the_last_rate_starts_that_bucket():
    m = RateMeter(window_ms=2_000)
    m.add(999)
    m.rate(1_000)
    m.add(1_000)  # the second bucket, though the cached rate is of this millisecond
    assert [start for start, _ in m._counts] == [0, 1_000]
    assert m.rate(2_500) == pytest.approx(1 * 1000 / (2_500 - 999))  # the first bucket aged out


def test_the_outlook_is_the_drain_rate_and_the_load_and_check_with_it_is_check_without_it():
    q = QueueModel([0, 0, 3, 0, 0])
    for t in range(0, 2_000, 20):
        q.finished(NORMAL, t)
    for t in range(0, 2_000, 10):
        q.admitted(NORMAL, t)
    rate, load = q.outlook(2_000)
    assert rate == q.drain_rate(2_000) and load == q.load(2_000)
    assert q.check(NORMAL, 2_000, rate) == q.check(NORMAL, 2_000)
    assert q.eta_ms(NORMAL, 2_000, rate) == q.eta_ms(NORMAL, 2_000)
