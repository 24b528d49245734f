"""Token buckets (GCRA): requests and tokens, several limits, exact retry-after, no window edge."""

from __future__ import annotations

import random

import pytest

from pipeline.config import Settings
from pipeline.config.gateway import RateLimitSettings as Limit
from pipeline.errors import ConfigError
from pipeline.policy.ratelimit import admit, idle, settle

PER_SECOND = Limit("per_second", 1_000, requests=5, tokens=1_000)
PER_MINUTE = Limit("per_minute", 60_000, requests=20)


def test_a_full_bucket_admits_its_burst_then_says_which_limit_and_exactly_when():
    buckets = {}
    assert all(admit(buckets, [PER_SECOND], "m", 10, 10_000).admitted for _ in range(5))
    d = admit(buckets, [PER_SECOND], "m", 10, 10_000)
    assert not d.admitted and d.limit == "per_second"
    assert d.retry_after_ms == 200  # one request's worth of the 5-per-second rate
    assert not admit(buckets, [PER_SECOND], "m", 10, 10_199).admitted
    assert admit(buckets, [PER_SECOND], "m", 10, 10_200).admitted


def test_tokens_are_limited_too_and_a_request_that_can_never_fit_gets_no_retry_after():
    buckets = {}
    assert admit(buckets, [PER_SECOND], "m", 900, 0).admitted
    d = admit(buckets, [PER_SECOND], "m", 200, 0)
    assert not d.admitted and "tokens" in d.detail and d.retry_after_ms == 100  # 100 tokens at 1 per ms
    never = admit(buckets, [PER_SECOND], "m", 5_000, 2)
    assert not never.admitted and never.retry_after_ms == 0


def test_several_limits_at_once_and_the_longest_wait_wins():
    buckets = {}
    admitted = sum(admit(buckets, [PER_SECOND, PER_MINUTE], "m", 1, t).admitted for t in range(0, 10_000, 100))
    assert admitted == 20 + 3  # the minute's burst, then its rate (one per 3 s)
    d = admit(buckets, [PER_SECOND, PER_MINUTE], "m", 1, 10_000)
    assert d.limit == "per_minute" and 0 < d.retry_after_ms <= 3_000


def test_a_refused_request_is_charged_to_no_bucket():
    tight = Limit("tight", 1_000, requests=1)
    buckets = {}
    assert admit(buckets, [PER_SECOND, tight], "m", 1, 0).admitted
    before = {k: list(v) for k, v in buckets.items()}
    assert not admit(buckets, [PER_SECOND, tight], "m", 1, 1).admitted
    assert buckets == before


def test_tenant_model_scope_keeps_each_model_apart():
    limits = [Limit("model", 1_000, requests=1, scope="tenant_model")]
    buckets = {}
    assert admit(buckets, limits, "large", 1, 0).admitted
    assert admit(buckets, limits, "small", 1, 0).admitted
    assert not admit(buckets, limits, "large", 1, 0).admitted


@pytest.mark.parametrize("seed", range(5))
def test_no_interval_of_any_length_admits_more_than_rate_times_interval_plus_burst(seed):
    rnd = random.Random(seed)
    limit = Limit("l", 1_000, requests=10, burst=4)
    buckets, admitted, t = {}, [], 0.0
    while t < 20_000:
        t += rnd.expovariate(1 / 15.0)  # ~66 arrivals a second against a limit of 10
        if admit(buckets, [limit], "m", 1, t).admitted:
            admitted.append(t)
    for i, start in enumerate(admitted):
        for j in range(i, len(admitted)):
            span = admitted[j] - start
            assert j - i + 1 <= 4 + 10 * span / 1_000 + 1e-9
    assert len(admitted) >= 0.95 * (4 + 10 * 20)  # and it is not stingy either


def test_settling_refunds_unused_tokens_never_past_full_and_charges_an_overrun():
    limits = [Limit("t", 1_000, tokens=1_000)]
    buckets = {}
    assert admit(buckets, limits, "m", 800, 0).admitted
    assert not admit(buckets, limits, "m", 400, 0).admitted
    settle(buckets, limits, "m", -500, 0)  # it used 300 of the 800 charged
    assert admit(buckets, limits, "m", 400, 0).admitted
    settle(buckets, limits, "m", -10_000, 0)
    assert buckets["t"][1] == 0  # full, not fuller
    settle(buckets, limits, "m", 2_000, 0)
    assert not admit(buckets, limits, "m", 1, 500).admitted


def test_a_bucket_left_alone_fills_up_and_its_state_can_go():
    buckets = {}
    admit(buckets, [PER_SECOND], "m", 100, 0)
    assert not idle(buckets, 100)
    assert idle(buckets, 1_000)


@pytest.mark.parametrize("bad", [
    {"window_ms": 0, "requests": 1}, {"window_ms": 1000}, {"window_ms": 1000, "requests": -1},
    {"window_ms": 1000, "requests": 1, "scope": "model"}, {"window_ms": 1000, "requests": 1, "burst": -2},
    {"window_ms": 1000, "requests": 1, "per": 3}])
def test_invalid_limits_are_refused_with_the_key(bad):
    s = Settings()
    s.gateway.limits = {"x": bad}
    with pytest.raises(ConfigError, match="gateway.limits.x"):
        s.validate()
