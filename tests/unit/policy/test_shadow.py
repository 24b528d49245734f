"""Shadow limits: judged beside the real policy on the same facts, never changing them."""

from __future__ import annotations

from pipeline.config.gateway import RateLimitSettings as Limit
from pipeline.models import Priority
from pipeline.policy.admission import Action, Admission, DegradePolicy, RateLimits
from pipeline.policy.fairness import FairnessQuotas
from pipeline.policy.priority import PriorityPolicy
from pipeline.policy.queues import CappedView, QueueModel
from pipeline.policy.shadow import Shadow
from pipeline.policy.state import TenantState
from tests.unit.policy.test_admission import NOW, req

NORMAL = Priority.NORMAL.rank


def admission(queues, limits, caps=None):
    return Admission(PriorityPolicy(), RateLimits(limits), FairnessQuotas(caps or {}, floor=Priority.NORMAL), queues,
                     DegradePolicy())


def pair(real_limits, shadow_limits, shadow_queue_caps=None, shadow_caps=None):
    queues = QueueModel([0] * 5)
    real = admission(queues, real_limits)
    shadow = Shadow(admission(CappedView(queues, shadow_queue_caps or [0] * 5), shadow_limits, shadow_caps))
    return real, shadow, queues


def test_a_tighter_shadow_rate_refuses_what_the_real_policy_admits_and_changes_nothing_real():
    real, shadow, queues = pair([Limit("s", 1_000, requests=100)], [Limit("s", 1_000, requests=2, over="refuse")])
    state = TenantState()
    verdicts = []
    for i in range(5):
        r = req()
        verdicts.append(shadow.judge(r, NOW + i, state).action)
        assert real.decide(r, NOW + i, state).action is Action.DISPATCH
    assert verdicts == [Action.DISPATCH] * 2 + [Action.REJECT] * 3
    # The real state holds five admissions, charged once each by the real buckets only.
    assert state.outstanding[NORMAL] == 5 and queues.depth[NORMAL] == 5
    real_again = admission(QueueModel([0] * 5), [Limit("s", 1_000, requests=100)])
    alone = TenantState()
    for i in range(5):
        real_again.decide(req(), NOW + i, alone)
    assert state.buckets == alone.buckets


def test_the_shadow_refuses_with_the_real_policys_reasons_and_retry_after():
    _, shadow, _ = pair([], [Limit("per_second", 1_000, requests=1, over="refuse")])
    state = TenantState()
    assert shadow.judge(req(), NOW, state).action is Action.DISPATCH
    d = shadow.judge(req(), NOW + 250, state)
    assert d.action is Action.REJECT and d.reason.startswith("rate_limited: limit per_second")
    assert d.retry_after_ms == 750


def test_the_shadow_sees_the_real_outstanding_requests_and_queue_depths_under_its_own_caps():
    real, shadow, queues = pair([], [], shadow_queue_caps=[0, 0, 3, 0, 0], shadow_caps={"NORMAL": 2})
    state = TenantState()
    for i in range(2):
        real.decide(req(), NOW + i, state)
    d = shadow.judge(req(), NOW + 2, state)
    assert d.action is Action.REJECT and d.reason.startswith("quota_exceeded")
    other = TenantState()
    real.decide(req(tenant="beta"), NOW + 3, other)  # the band now holds 3: the shadow's cap
    d = shadow.judge(req(tenant="gamma"), NOW + 4, TenantState())
    assert d.action is Action.REJECT and d.reason.startswith("queue_full: band NORMAL holds 3 requests (cap 3)")
    assert queues.depth[NORMAL] == 3 and queues.caps[NORMAL] == 0  # the real queue: uncapped, unchanged


def test_idle_shadow_buckets_are_forgotten():
    _, shadow, _ = pair([], [Limit("s", 1_000, requests=10)])
    shadow.judge(req(), NOW, TenantState())
    assert shadow.sweep(NOW + 10) == 1
    assert shadow.sweep(NOW + 2_000) == 0
