"""Effective priority: tier offsets, deadline urgency, load demotion, clamping."""

from __future__ import annotations

import pytest

from pipeline.models import Priority
from pipeline.policy.priority import PriorityPolicy, effective_priority

POLICY = PriorityPolicy()
RELAXED = dict(time_left_ms=60_000, eta_ms=100.0, load=0.1)


def decide(requested, tier="standard", **kw):
    return effective_priority(requested, tier, **{**RELAXED, **kw}, policy=POLICY)


@pytest.mark.parametrize("band", list(Priority))
def test_a_standard_tenant_with_time_to_spare_at_low_load_keeps_its_band(band):
    d = decide(band)
    assert d.effective is band and d.reasons == ()


def test_tier_offsets_move_enterprise_up_and_free_down():
    assert decide(Priority.NORMAL, "enterprise").effective is Priority.HIGH
    assert decide(Priority.NORMAL, "free").effective is Priority.LOW
    assert decide(Priority.NORMAL, "unknown-tier").effective is Priority.NORMAL


def test_an_urgent_deadline_moves_up_one_band():
    assert decide(Priority.LOW, time_left_ms=1_000).effective is Priority.NORMAL
    # urgent relative to the queue's current ETA, too
    d = decide(Priority.LOW, time_left_ms=5_000, eta_ms=3_000)
    assert d.effective is Priority.NORMAL and "deadline urgent +1" in d.reasons


def test_promotion_never_reaches_critical_unless_asked_for():
    assert decide(Priority.HIGH, "enterprise", time_left_ms=10).effective is Priority.HIGH
    assert decide(Priority.CRITICAL, "free").effective is Priority.HIGH  # tiers still demote


def test_high_load_moves_non_critical_work_down_but_not_critical():
    assert decide(Priority.HIGH, load=0.9).effective is Priority.NORMAL
    assert decide(Priority.CRITICAL, load=0.99).effective is Priority.CRITICAL
    assert decide(Priority.BACKGROUND, load=0.99).effective is Priority.BACKGROUND  # clamped


def test_threshold_is_configurable():
    policy = PriorityPolicy(high_load=0.5)
    assert effective_priority(Priority.NORMAL, "standard", 60_000, 0, 0.6, policy).effective is Priority.LOW


def test_the_rule_is_a_pure_function():
    assert decide(Priority.LOW, "free", load=0.95) == decide(Priority.LOW, "free", load=0.95)


def test_a_band_above_the_highest_promotion_is_clamped_even_when_nothing_else_moves_it():
    policy = PriorityPolicy(highest_promoted=Priority.NORMAL)
    d = effective_priority(Priority.HIGH, "standard", 60_000, 100.0, 0.1, policy)
    assert d.effective is Priority.NORMAL and d.requested is Priority.HIGH


def test_high_load_spares_a_tenant_holding_little_of_the_bands_queue():
    # The flooder made the load; the quiet tenant with 1 of the band's 200 queued keeps its band.
    assert decide(Priority.NORMAL, load=0.9, queue_share=1 / 200).effective is Priority.NORMAL
    d = decide(Priority.NORMAL, load=0.9, queue_share=0.6)
    assert d.effective is Priority.LOW and d.reasons == ("load 90% -1",)
    assert decide(Priority.NORMAL, load=0.9, queue_share=POLICY.load_spared_share).effective is Priority.LOW


def test_sparing_nobody_demotes_every_tenant_under_load():
    policy = PriorityPolicy(load_spared_share=0.0)
    assert effective_priority(Priority.NORMAL, "standard", 60_000, 0, 0.9, policy, 0.0).effective is Priority.LOW
