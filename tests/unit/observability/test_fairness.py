"""Jain's fairness index over a sliding window (pipeline.observability.fairness)."""

from __future__ import annotations

import math
import random

import pytest

from pipeline.observability.fairness import FairnessWindow, jain


def test_jain_index_bounds_and_known_values():
    assert jain([]) is None
    assert jain([1.0, 1.0, 1.0]) == 1.0
    assert jain([0.5, 0.5]) == 1.0  # an even shortage is still even-handed
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)  # one of four served: 1/n
    assert jain([1.0, 1.0, 0.0, 0.0]) == pytest.approx(0.5)  # k of n served: k/n
    assert jain([1.0, 0.5]) == pytest.approx(0.9)  # (1.5)^2 / (2 * 1.25)
    assert jain([0.0, 0.0]) == 1.0  # nothing admitted to anyone: equally refused


def test_window_counts_shares_per_tenant():
    w = FairnessWindow(window_s=60, slots=12)
    w.advance(1000.0)
    assert w.index() is None and w.tenants == 0
    for _ in range(4):
        w.observe("a", True)
    for admitted in (True, False, True, False):
        w.observe("b", admitted)
    assert w.shares() == {"a": 1.0, "b": 0.5}
    assert w.tenants == 2
    assert w.index() == pytest.approx(0.9)


def test_observations_leave_with_their_slot():
    w = FairnessWindow(window_s=60, slots=12)  # 5 s slots
    w.advance(0.0)
    w.observe("starved", False)
    w.advance(30.0)
    w.observe("served", True)
    assert w.index() == pytest.approx(0.5)
    w.advance(59.9)  # slot 11: the first slot is still in the window
    assert w.tenants == 2
    w.advance(60.0)  # slot 12 takes the first slot's place
    assert w.shares() == {"served": 1.0}
    assert w.index() == 1.0
    w.advance(10_000.0)  # far later: everything expired at once
    assert w.index() is None and w.tenants == 0


def test_a_clock_going_back_keeps_counting_in_the_current_slot():
    w = FairnessWindow(window_s=10, slots=2)
    w.advance(100.0)
    w.observe("a", True)
    w.advance(90.0)
    w.observe("a", False)
    assert w.shares() == {"a": 0.5}


def test_incremental_sums_match_a_recount_of_the_window():
    rng = random.Random(3)
    window_s, slots = 20.0, 4
    slot_s = window_s / slots
    w = FairnessWindow(window_s, slots)
    events: list[tuple[int, str, bool]] = []  # (slot number, tenant, admitted)
    now = 0.0
    w.advance(now)
    for step in range(3000):
        if rng.random() < 0.05:
            now += rng.choice((0.5, 2.0, 7.0, 30.0))
            w.advance(now)
        tenant = f"t{rng.randrange(12)}"
        admitted = rng.random() < (0.9 if tenant < "t5" else 0.3)
        w.observe(tenant, admitted)
        events.append((math.floor(now / slot_s), tenant, admitted))
        if step % 50 == 0:
            current = math.floor(now / slot_s)
            counts: dict[str, list[int]] = {}
            for slot, t, a in events:
                if slot > current - slots:
                    c = counts.setdefault(t, [0, 0])
                    c[0] += a
                    c[1] += 1
            expected = jain([a / r for a, r in counts.values()])
            assert w.tenants == len(counts)
            if expected is None:
                assert w.index() is None
            else:
                assert w.index() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_window_arguments_are_checked():
    with pytest.raises(ValueError):
        FairnessWindow(window_s=0)
    with pytest.raises(ValueError):
        FairnessWindow(slots=0)
