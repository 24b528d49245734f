"""A tenant's state record: what it holds, its table form, and when it can be forgotten."""

from __future__ import annotations

import json

from pipeline.config.gateway import RateLimitSettings as Limit
from pipeline.models import Priority
from pipeline.policy import ratelimit
from pipeline.policy.state import TenantState


def test_a_record_survives_its_table_form():
    state = TenantState()
    state.admitted(Priority.HIGH.rank)
    ratelimit.admit(state.buckets, [Limit("s", 1_000, requests=5, tokens=100)], "m", 10, 1_000)
    back = TenantState.from_value(json.loads(json.dumps(state.to_value())))
    assert back == state


def test_a_record_of_another_shape_reads_as_a_fresh_tenant():
    assert TenantState.from_value(None) == TenantState()
    assert TenantState.from_value({"o": [1, 2], "b": {"x": "junk"}}).outstanding == [1, 2, 0, 0, 0]


def test_idle_means_nothing_outstanding_and_every_bucket_full():
    state = TenantState()
    ratelimit.admit(state.buckets, [Limit("s", 1_000, requests=5)], "m", 1, 0)
    assert not state.idle(100) and state.idle(200)
    state.admitted(0)
    assert not state.idle(10_000)
