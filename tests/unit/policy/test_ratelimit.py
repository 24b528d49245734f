"""Windowed rate limits: requests and tokens, several windows, never over the limit."""

from __future__ import annotations

import random

import pytest

from pipeline.policy.ratelimit import RateLimiter, WindowLimit, window_start

PER_SECOND = WindowLimit("per_second", 1_000, requests=5, tokens=1_000)
PER_MINUTE = WindowLimit("per_minute", 60_000, requests=20)


def test_admits_up_to_the_request_limit_then_says_which_limit_and_when():
    rl = RateLimiter([PER_SECOND])
    assert all(rl.admit("acme", "m", 10, 10_100).admitted for _ in range(5))
    d = rl.admit("acme", "m", 10, 10_400)
    assert not d.admitted and d.limit == "per_second"
    assert d.retry_after_ms == 600  # the window [10 000, 11 000) has room at 11 000
    assert rl.admit("acme", "m", 10, 11_000).admitted


def test_tokens_are_limited_too_and_a_request_that_can_never_fit_gets_no_retry_after():
    rl = RateLimiter([PER_SECOND])
    assert rl.admit("acme", "m", 900, 0).admitted
    d = rl.admit("acme", "m", 200, 1)
    assert not d.admitted and "tokens" in d.detail and d.retry_after_ms == 999
    never = rl.admit("acme", "m", 5_000, 2)
    assert not never.admitted and never.retry_after_ms == 0


def test_several_windows_at_once_and_the_longest_wait_wins():
    rl = RateLimiter([PER_SECOND, PER_MINUTE])
    admitted = sum(rl.admit("acme", "m", 1, t).admitted for t in range(0, 10_000, 100))
    assert admitted == 20  # the minute limit binds
    d = rl.admit("acme", "m", 1, 10_000)
    assert d.limit == "per_minute" and d.retry_after_ms == 50_000


def test_a_refused_request_counts_in_no_window():
    rl = RateLimiter([PER_SECOND, WindowLimit("tight", 1_000, requests=1)])
    assert rl.admit("acme", "m", 1, 0).admitted
    assert not rl.admit("acme", "m", 1, 1).admitted
    assert rl.counts[next(k for k in rl.counts if k[0] == "per_second")] == [1, 1]


def test_tenants_are_independent_and_may_have_their_own_limits():
    rl = RateLimiter([WindowLimit("s", 1_000, requests=1)], {"big": [WindowLimit("s", 1_000, requests=3)]})
    assert rl.admit("a", "m", 1, 0).admitted and not rl.admit("a", "m", 1, 0).admitted
    assert rl.admit("b", "m", 1, 0).admitted
    assert [rl.admit("big", "m", 1, 0).admitted for _ in range(4)] == [True, True, True, False]


def test_tenant_model_scope_counts_each_model_apart():
    rl = RateLimiter([WindowLimit("model", 1_000, requests=1, scope="tenant_model")])
    assert rl.admit("a", "large", 1, 0).admitted
    assert rl.admit("a", "small", 1, 0).admitted
    assert not rl.admit("a", "large", 1, 0).admitted


def test_never_over_the_limit_under_random_arrivals():
    rng = random.Random(3)
    limits = [WindowLimit("s", 1_000, requests=7, tokens=500), WindowLimit("m", 10_000, requests=40)]
    rl = RateLimiter(limits)
    admitted = []
    for t in sorted(rng.randrange(0, 60_000) for _ in range(5_000)):
        tokens = rng.randrange(1, 120)
        if rl.admit("t", "m", tokens, t).admitted:
            admitted.append((t, tokens))
    for lim in limits:
        per_window = {}
        for t, tokens in admitted:
            c = per_window.setdefault(window_start(t, lim.window_ms), [0, 0])
            c[0] += 1
            c[1] += tokens
        assert max(c[0] for c in per_window.values()) <= lim.requests
        if lim.tokens:
            assert max(c[1] for c in per_window.values()) <= lim.tokens


def test_expire_drops_ended_windows_only():
    rl = RateLimiter([PER_SECOND, PER_MINUTE])
    rl.admit("a", "m", 1, 500)
    assert rl.expire(1_500) == 1  # the second's window ended; the minute's did not
    assert rl.expire(60_000) == 1 and not rl.counts


@pytest.mark.parametrize("bad", [dict(window_ms=0, requests=1), dict(window_ms=1000), dict(window_ms=1, requests=-1),
                                 dict(window_ms=1, requests=1, scope="global")])
def test_invalid_limits_are_refused(bad):
    with pytest.raises(ValueError):
        WindowLimit("x", **bad)


class _PerLimitCounts(dict):
    """Counts kept apart per limit, as the gateway's tables keep them (one per limit)."""

    def __init__(self):
        super().__init__()
        self.parts: dict[str, dict] = {}

    def for_limit(self, name: str) -> dict:
        return self.parts.setdefault(name, {})


def test_a_mapping_that_keeps_limits_apart_gets_each_limits_counts_in_its_own_part():
    counts = _PerLimitCounts()
    rl = RateLimiter([PER_SECOND, PER_MINUTE], counts=counts)
    for _ in range(5):
        assert rl.admit("acme", "m", 10, 10_100).admitted
    assert not rl.admit("acme", "m", 10, 10_200).admitted  # per_second is full
    assert counts.parts["per_second"] == {("per_second", "acme", 10_000): [5, 50]}
    assert counts.parts["per_minute"] == {("per_minute", "acme", 0): [5, 50]}
    assert dict(counts) == {}
