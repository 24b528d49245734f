"""The composed admission decision: order of checks, nothing counted for a refused request."""

from __future__ import annotations

from pipeline.models import Priority, Request
from pipeline.policy.admission import Action, Admission, DegradePolicy
from pipeline.policy.fairness import FairnessQuotas
from pipeline.policy.priority import PriorityPolicy
from pipeline.policy.queues import QueueModel
from pipeline.policy.ratelimit import RateLimiter, WindowLimit

NOW = 1_800_000_000_000


def make(limits=None, caps=None, queue_caps=None, degrade=None, max_timeout_ms=600_000):
    return Admission(PriorityPolicy(), RateLimiter(limits or [WindowLimit("s", 1_000, requests=1000)]),
                     FairnessQuotas(caps or {}, floor=Priority.LOW), QueueModel(queue_caps or [0] * 5),
                     degrade or DegradePolicy(), max_timeout_ms=max_timeout_ms)


def req(**kw):
    base = dict(priority=Priority.NORMAL, created_at=NOW, timeout_ms=60_000)
    base.update(kw)
    tenant = base.pop("tenant", "acme")
    return Request.new(tenant, base.pop("prompt", "hello"), **base)


def test_a_plain_request_is_dispatched_in_its_band_and_counted():
    adm = make()
    d = adm.decide(req(), NOW)
    assert d.action is Action.DISPATCH and d.band is Priority.NORMAL and d.position == 1
    assert adm.queues.depth[Priority.NORMAL.rank] == 1
    assert adm.quotas.outstanding("acme", Priority.NORMAL) == 1


def test_invalid_requests_are_rejected_with_the_reason():
    d = make().decide(req(tenant=" "), NOW)
    assert d.action is Action.REJECT and d.reason.startswith("invalid_request")


def test_cancelled_and_expired_requests_are_never_dispatched():
    assert make().decide(req(), NOW, cancelled=True).action is Action.CANCEL
    d = make().decide(req(created_at=NOW - 61_000), NOW)
    assert d.action is Action.EXPIRE and "deadline passed" in d.reason


def test_the_server_maximum_shortens_a_longer_client_timeout():
    adm = make(max_timeout_ms=10_000)
    assert adm.decide(req(created_at=NOW - 11_000, timeout_ms=3_600_000), NOW).action is Action.EXPIRE


def test_rate_limited_says_which_limit_and_when_and_counts_nothing_else():
    adm = make(limits=[WindowLimit("per_second", 1_000, requests=1)])
    assert adm.decide(req(), NOW).action is Action.DISPATCH
    d = adm.decide(req(), NOW + 250)
    assert d.action is Action.REJECT and d.reason.startswith("rate_limited: limit per_second")
    assert d.retry_after_ms == 750
    assert adm.queues.depth[Priority.NORMAL.rank] == 1
    assert adm.quotas.outstanding("acme", Priority.NORMAL) == 1


def test_quota_demotes_then_refuses_with_retry_after():
    adm = make(caps={"NORMAL": 1, "LOW": 1})
    assert adm.decide(req(), NOW).band is Priority.NORMAL
    d = adm.decide(req(), NOW)
    assert d.band is Priority.LOW and "quota: demoted from NORMAL" in d.notes
    d = adm.decide(req(), NOW)
    assert d.action is Action.REJECT and d.reason.startswith("quota_exceeded") and d.retry_after_ms >= 100
    assert adm.decide(req(tenant="quiet"), NOW).action is Action.DISPATCH


def test_a_full_band_rejects_queue_full_and_a_rate_limit_is_not_spent():
    adm = make(queue_caps=[0, 0, 1, 0, 0], limits=[WindowLimit("s", 1_000, requests=2)])
    assert adm.decide(req(), NOW).action is Action.DISPATCH
    d = adm.decide(req(), NOW)
    assert d.action is Action.REJECT and d.reason.startswith("queue_full") and d.retry_after_ms > 0
    adm.finished("acme", Priority.NORMAL, NOW)
    assert adm.decide(req(), NOW).action is Action.DISPATCH  # the refused one spent no budget


def test_a_deadline_the_queue_cannot_meet_expires_at_once():
    adm = make()
    for t in range(0, 2_000, 10):  # drains 100/s
        adm.queues.admitted(Priority.NORMAL.rank, NOW - 2_000 + t)
        adm.queues.finished(Priority.NORMAL.rank, NOW - 2_000 + t)
    for _ in range(1_000):  # 10 s of work ahead
        adm.queues.admitted(Priority.NORMAL.rank, NOW)
    d = adm.decide(req(timeout_ms=5_000, prompt="x"), NOW)
    assert d.action is Action.EXPIRE and "cannot be met" in d.reason


def test_under_load_a_simple_request_that_allows_it_gets_the_smaller_model():
    adm = make(degrade=DegradePolicy(load=0.5, downgrade={"big": "small"}))
    for t in range(0, 2_000, 10):
        adm.queues.admitted(Priority.LOW.rank, NOW - 2_000 + t)
        adm.queues.admitted(Priority.LOW.rank, NOW - 2_000 + t)  # arrivals at twice the drain
        adm.queues.finished(Priority.LOW.rank, NOW - 2_000 + t)
    d = adm.decide(req(model="big", allow_degrade=True, max_tokens=64), NOW)
    assert d.action is Action.DISPATCH and d.model == "small" and d.degraded_from == "big"
    assert adm.decide(req(model="big", max_tokens=64), NOW).model == "big"  # not allowed
    assert adm.decide(req(model="big", allow_degrade=True, max_tokens=4096), NOW).model == "big"  # not simple
