"""Fairness quotas: outstanding caps per tenant and band, demotion to the floor, then refusal."""

from __future__ import annotations

from pipeline.models import Priority
from pipeline.policy.fairness import FairnessQuotas

CAPS = {"CRITICAL": 1, "HIGH": 2, "NORMAL": 2, "LOW": 0, "BACKGROUND": 3}


def test_under_the_cap_the_requested_band_is_kept():
    q = FairnessQuotas(CAPS, floor=Priority.LOW)
    p = q.place("a", Priority.HIGH)
    assert p.band is Priority.HIGH and p.demoted_from is None


def test_over_the_cap_a_request_is_demoted_band_by_band_down_to_the_floor_then_refused():
    q = FairnessQuotas(CAPS, floor=Priority.NORMAL)
    for _ in range(2):
        q.admitted("a", Priority.HIGH)
    p = q.place("a", Priority.HIGH)
    assert p.band is Priority.NORMAL and p.demoted_from is Priority.HIGH
    for _ in range(2):
        q.admitted("a", Priority.NORMAL)
    assert q.place("a", Priority.HIGH).band is None  # floor NORMAL reached
    assert q.place("b", Priority.HIGH).band is Priority.HIGH  # other tenants unaffected


def test_a_cap_of_zero_means_no_cap():
    q = FairnessQuotas(CAPS, floor=Priority.LOW)
    for _ in range(1000):
        q.admitted("a", Priority.LOW)
    assert q.place("a", Priority.LOW).band is Priority.LOW


def test_completions_free_room_and_empty_counters_disappear():
    q = FairnessQuotas(CAPS)
    q.admitted("a", Priority.CRITICAL)
    assert q.place("a", Priority.CRITICAL).band is not Priority.CRITICAL
    q.finished("a", Priority.CRITICAL)
    assert q.place("a", Priority.CRITICAL).band is Priority.CRITICAL
    assert q.counts == {}
    q.finished("a", Priority.CRITICAL)  # a stray completion never goes negative
    assert q.outstanding("a", Priority.CRITICAL) == 0


def test_per_tenant_caps_override_the_default():
    q = FairnessQuotas(CAPS, tenant_caps={"big": {"CRITICAL": 10}})
    for _ in range(5):
        q.admitted("big", Priority.CRITICAL)
    assert q.place("big", Priority.CRITICAL).band is Priority.CRITICAL


def test_a_request_below_the_floor_is_not_moved_up_to_it():
    q = FairnessQuotas(CAPS, floor=Priority.NORMAL)
    for _ in range(3):
        q.admitted("a", Priority.BACKGROUND)
    assert q.place("a", Priority.BACKGROUND).band is None


class CountingMapping(dict):
    """A mapping that counts in one step, as the gateway's table view does."""

    def __init__(self):
        super().__init__()
        self.adds = 0

    def add(self, key, n=1):
        self.adds += 1
        self[key] = self.get(key, 0) + n


def test_a_counting_mapping_is_added_to_in_one_step_with_the_same_result():
    counted, plain = CountingMapping(), {}
    for counts in (counted, plain):
        q = FairnessQuotas(CAPS, floor=Priority.LOW, counts=counts)
        q.admitted("a", Priority.NORMAL)
        q.admitted("a", Priority.NORMAL)
        assert q.place("a", Priority.NORMAL).band is Priority.LOW
    assert counted == plain and counted.adds == 2
