"""service_tier as bands: flex one down, priority one up within the tenant's cap, and the tier answered."""

from __future__ import annotations

from pipeline.models import Priority as P
from pipeline.policy.service_tier import band_for, served_tier


def _cap(highest: P):
    return lambda p: p if p.rank >= highest.rank else highest


def test_the_mapping():
    free = _cap(P.CRITICAL)
    assert band_for(None, P.NORMAL, free) == (P.NORMAL, P.NORMAL)
    assert band_for("auto", P.NORMAL, free) == (P.NORMAL, P.NORMAL)
    assert band_for("default", P.LOW, free) == (P.LOW, P.LOW)
    assert band_for("flex", P.NORMAL, free) == (P.LOW, P.NORMAL)
    assert band_for("flex", P.BACKGROUND, free) == (P.BACKGROUND, P.BACKGROUND)
    assert band_for("priority", P.NORMAL, free) == (P.HIGH, P.NORMAL)
    assert band_for("priority", P.NORMAL, _cap(P.NORMAL)) == (P.NORMAL, P.NORMAL)  # not allowed up: default
    assert band_for(None, P.HIGH, _cap(P.NORMAL)) == (P.NORMAL, P.NORMAL)


def test_the_tier_answered():
    assert served_tier("flex", P.NORMAL, P.LOW) == "flex"
    assert served_tier("flex", P.BACKGROUND, P.BACKGROUND) == "flex"
    assert served_tier("priority", P.NORMAL, P.HIGH) == "priority"
    assert served_tier("priority", P.NORMAL, P.NORMAL) == "default"
    assert served_tier(None, P.NORMAL, P.NORMAL) == "default"
    assert served_tier("auto", P.LOW, None) == "default"
