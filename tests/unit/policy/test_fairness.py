"""Fairness quotas: outstanding caps per tenant and band, demotion to the floor, then refusal."""

from __future__ import annotations

from pipeline.models import Priority
from pipeline.policy.fairness import FairnessQuotas
from pipeline.policy.state import TenantState

CAPS = {"CRITICAL": 1, "HIGH": 2, "NORMAL": 2, "LOW": 0, "BACKGROUND": 3}


def outstanding(**bands) -> TenantState:
    state = TenantState()
    for band, n in bands.items():
        for _ in range(n):
            state.admitted(Priority[band].rank)
    return state


def test_under_the_cap_the_requested_band_is_kept():
    q = FairnessQuotas(CAPS, floor=Priority.LOW)
    p = q.place("a", Priority.HIGH, TenantState().outstanding)
    assert p.band is Priority.HIGH and p.demoted_from is None


def test_over_the_cap_a_request_is_demoted_band_by_band_down_to_the_floor_then_refused():
    q = FairnessQuotas(CAPS, floor=Priority.NORMAL)
    p = q.place("a", Priority.HIGH, outstanding(HIGH=2).outstanding)
    assert p.band is Priority.NORMAL and p.demoted_from is Priority.HIGH
    assert q.place("a", Priority.HIGH, outstanding(HIGH=2, NORMAL=2).outstanding).band is None  # floor NORMAL


def test_a_cap_of_zero_means_no_cap():
    q = FairnessQuotas(CAPS, floor=Priority.LOW)
    assert q.place("a", Priority.LOW, outstanding(LOW=1000).outstanding).band is Priority.LOW


def test_completions_free_room_and_never_go_negative():
    q = FairnessQuotas(CAPS)
    state = outstanding(CRITICAL=1)
    assert q.place("a", Priority.CRITICAL, state.outstanding).band is not Priority.CRITICAL
    state.finished(Priority.CRITICAL.rank)
    assert q.place("a", Priority.CRITICAL, state.outstanding).band is Priority.CRITICAL
    state.finished(Priority.CRITICAL.rank)  # a stray completion
    assert state.outstanding[Priority.CRITICAL.rank] == 0


def test_per_tenant_caps_override_the_default():
    q = FairnessQuotas(CAPS, tenant_caps={"big": {"CRITICAL": 10}})
    assert q.place("big", Priority.CRITICAL, outstanding(CRITICAL=5).outstanding).band is Priority.CRITICAL
    assert q.place("small", Priority.CRITICAL, outstanding(CRITICAL=5).outstanding).band is not Priority.CRITICAL


def test_a_request_below_the_floor_is_not_moved_up_to_it():
    q = FairnessQuotas(CAPS, floor=Priority.NORMAL)
    assert q.place("a", Priority.BACKGROUND, outstanding(BACKGROUND=3).outstanding).band is None
