"""The composed admission decision: order of checks, nothing charged for a refused request."""

from __future__ import annotations

from pipeline.config.gateway import RateLimitSettings as Limit
from pipeline.models import Priority, Request
from pipeline.policy.admission import Action, Admission, DegradePolicy, RateLimits
from pipeline.policy.fairness import FairnessQuotas
from pipeline.policy.priority import PriorityPolicy
from pipeline.policy.queues import QueueModel
from pipeline.policy.state import TenantState

NOW = 1_800_000_000_000


def make(limits=None, caps=None, queue_caps=None, degrade=None, max_timeout_ms=600_000):
    return Admission(PriorityPolicy(), RateLimits(limits or [Limit("s", 1_000, requests=1000)]),
                     FairnessQuotas(caps or {}, floor=Priority.LOW), QueueModel(queue_caps or [0] * 5),
                     degrade or DegradePolicy(), max_timeout_ms=max_timeout_ms)


def req(**kw):
    base = dict(priority=Priority.NORMAL, created_at=NOW, timeout_ms=60_000)
    base.update(kw)
    tenant = base.pop("tenant", "acme")
    return Request.new(tenant, base.pop("prompt", "hello"), **base)


def draining(adm: Admission, per_s: float, depths=(0, 0, 0, 0, 0), seconds: int = 5) -> None:
    """Observations of the dispatch topics: ``per_s`` drained and arriving, ``depths`` queued."""
    for i in range(seconds * 2 + 1):
        total = int(per_s * i / 2)
        adm.queues.observe(list(depths), total + sum(depths), total, NOW - seconds * 1000 + i * 500)


def test_a_plain_request_is_dispatched_in_its_band_and_counted():
    adm, state = make(), TenantState()
    d = adm.decide(req(), NOW, state)
    assert d.action is Action.DISPATCH and d.band is Priority.NORMAL and d.position == 1
    assert adm.queues.depth[Priority.NORMAL.rank] == 1
    assert state.outstanding[Priority.NORMAL.rank] == 1
    assert d.charged_tokens == 2 + 256  # the prompt's estimate and max_tokens


def test_invalid_requests_are_rejected_with_the_reason():
    d = make().decide(req(tenant=" "), NOW, TenantState())
    assert d.action is Action.REJECT and d.reason.startswith("invalid_request")


def test_cancelled_and_expired_requests_are_never_dispatched():
    assert make().decide(req(), NOW, TenantState(), cancelled=True).action is Action.CANCEL
    d = make().decide(req(created_at=NOW - 61_000), NOW, TenantState())
    assert d.action is Action.EXPIRE and "deadline passed" in d.reason


def test_the_server_maximum_shortens_a_longer_client_timeout():
    adm = make(max_timeout_ms=10_000)
    assert adm.decide(req(created_at=NOW - 11_000, timeout_ms=3_600_000), NOW, TenantState()).action is Action.EXPIRE


def test_rate_limited_says_which_limit_and_when_and_charges_nothing_else():
    adm, state = make(limits=[Limit("per_second", 1_000, requests=1, over="refuse")]), TenantState()
    assert adm.decide(req(), NOW, state).action is Action.DISPATCH
    d = adm.decide(req(), NOW + 250, state)
    assert d.action is Action.REJECT and d.reason.startswith("rate_limited: limit per_second")
    assert d.retry_after_ms == 750
    assert adm.queues.depth[Priority.NORMAL.rank] == 1
    assert state.outstanding[Priority.NORMAL.rank] == 1


def test_quota_demotes_then_refuses_with_retry_after():
    adm, state = make(caps={"NORMAL": 1, "LOW": 1}), TenantState()
    assert adm.decide(req(), NOW, state).band is Priority.NORMAL
    d = adm.decide(req(), NOW, state)
    assert d.band is Priority.LOW and "quota: demoted from NORMAL" in d.notes
    d = adm.decide(req(), NOW, state)
    assert d.action is Action.REJECT and d.reason.startswith("quota_exceeded") and d.retry_after_ms >= 100
    assert adm.decide(req(tenant="quiet"), NOW, TenantState()).action is Action.DISPATCH


def test_a_full_band_rejects_queue_full_and_a_rate_limit_is_not_spent():
    adm, state = make(queue_caps=[0, 0, 1, 0, 0], limits=[Limit("s", 1_000, requests=2)]), TenantState()
    assert adm.decide(req(), NOW, state).action is Action.DISPATCH
    d = adm.decide(req(), NOW, state)
    assert d.action is Action.REJECT and d.reason.startswith("queue_full") and d.retry_after_ms > 0
    adm.queues.observe([0] * 5, 1, 1, NOW)  # the dispatch topic drained
    assert adm.decide(req(), NOW, state).action is Action.DISPATCH  # the refused one spent no budget


def test_a_deadline_the_queue_cannot_meet_even_at_twice_the_fastest_drain_expires_at_once():
    adm = make()
    draining(adm, 100, depths=(0, 0, 1_000, 0, 0))  # 10 s of work ahead at 100/s
    # The tenant's own backlog: the load moves its urgent request back down to NORMAL.
    d = adm.decide(req(timeout_ms=3_000, prompt="x"), NOW, TenantState(outstanding=[0, 0, 1_000, 0, 0]))
    assert d.action is Action.EXPIRE and "cannot be met" in d.reason
    # 5 s would be enough were the workers twice as fast (more of them started): admitted.
    d = adm.decide(req(timeout_ms=5_000, prompt="x"), NOW, TenantState(outstanding=[0, 0, 1_000, 0, 0]))
    assert d.action is Action.DISPATCH and d.eta_ms > 5_000


def test_after_an_idle_spell_a_burst_is_admitted_with_the_last_capacity_as_its_eta():
    adm = make()
    draining(adm, 100, depths=(0, 0, 1_000, 0, 0))  # capacity measured: 100/s
    later = NOW + 100_000
    for i in range(1, 201):  # 100 s of nothing: no work, no drain
        adm.queues.observe([0] * 5, 100_000, 100_000, NOW + i * 500)
    decisions = [adm.decide(req(created_at=later, timeout_ms=2_000, prompt="x"), later, TenantState())
                 for _ in range(300)]
    assert all(d.action is Action.DISPATCH for d in decisions)  # no recent evidence: never refused early
    # The 300th waits behind 299 at the capacity measured before the idle spell, not forever.
    assert decisions[-1].eta_ms < 3_100


def test_without_any_drain_measured_nothing_is_refused_as_too_late():
    adm = make()
    adm.queues.observe([0, 0, 5_000, 0, 0], 5_000, 0, NOW - 500)
    d = adm.decide(req(prompt="x"), NOW, TenantState())
    assert d.action is Action.DISPATCH and d.eta_ms == float("inf")


def test_a_tenant_with_nothing_queued_in_a_loaded_band_keeps_its_band_and_its_urgency():
    adm = make()
    draining(adm, 100, depths=(0, 0, 1_000, 0, 0))  # someone else's 10 s of work
    d = adm.decide(req(timeout_ms=5_000, prompt="x"), NOW, TenantState())
    assert d.action is Action.DISPATCH and d.band is Priority.HIGH and d.notes == ("deadline urgent +1",)
    assert adm.decide(req(prompt="x"), NOW, TenantState()).band is Priority.NORMAL


def test_under_load_a_simple_request_that_allows_it_gets_the_smaller_model():
    adm = make(degrade=DegradePolicy(load=0.5, downgrade={"big": "small"}))
    adm.queues.waited(Priority.NORMAL.rank, 5_000, NOW)  # NORMAL's requests wait 5 s
    d = adm.decide(req(model="big", allow_degrade=True, max_tokens=64), NOW, TenantState())
    assert d.action is Action.DISPATCH and d.model == "small" and d.degraded_from == "big"
    assert adm.decide(req(model="big", max_tokens=64), NOW, TenantState()).model == "big"  # not allowed
    assert adm.decide(req(model="big", allow_degrade=True, max_tokens=4096), NOW, TenantState()).model == "big"


def test_a_background_backlog_is_no_load_for_normal():
    adm = make(degrade=DegradePolicy(load=0.5, downgrade={"big": "small"}))
    adm.queues.waited(Priority.BACKGROUND.rank, 60_000, NOW)
    draining(adm, 100, depths=(0, 0, 0, 0, 50_000))
    assert adm.decide(req(model="big", allow_degrade=True, max_tokens=64), NOW, TenantState()).model == "big"


def test_a_finished_request_frees_its_quota_and_refunds_its_unused_tokens():
    limits = [Limit("t", 60_000, tokens=1_000)]
    adm, state = make(limits=limits, caps={"NORMAL": 1, "LOW": 1}), TenantState()
    d = adm.decide(req(max_tokens=900), NOW, state)
    assert d.action is Action.DISPATCH
    assert adm.decide(req(tenant="acme", max_tokens=900), NOW, state).reason.startswith("rate_limited")
    adm.finished("acme", state, d.band, d.model, d.charged_tokens, 50, NOW)
    assert state.outstanding == [0] * 5
    assert adm.decide(req(max_tokens=900), NOW, state).action is Action.DISPATCH


def test_a_long_backlog_read_after_later_ones_meets_the_buckets_as_they_are_not_their_debts():
    # Five band topics are not read in arrival order: a band's backlog, older than the reorder
    # window, comes behind another band's fresh requests. 100 requests a second, burst 100: room
    # for all of them.
    adm, state = make(limits=[Limit("s", 1_000, requests=100, burst=100, over="refuse")]), TenantState()
    fresh = [adm.decide(req(prompt=f"f{i}"), NOW, state, arrived_ms=NOW) for i in range(50)]
    backlog = [adm.decide(req(prompt=f"b{i}", priority=Priority.LOW), NOW, state, arrived_ms=NOW - 60_000 + i * 100)
               for i in range(40)]
    assert all(d.action is Action.DISPATCH for d in fresh + backlog)
    # And the limit still holds at the latest arrival: 100 within the burst, then refused.
    more = [adm.decide(req(prompt=f"m{i}"), NOW, state, arrived_ms=NOW - 50_000) for i in range(20)]
    assert [d.action for d in more].count(Action.DISPATCH) == 10
    assert state.clock == NOW


def _worst_excess(times_ms: list[int], interval_ms: float) -> float:
    times = sorted(times_ms)
    return max(((j - i + 1) - (times[j] - times[i]) / interval_ms
                for i in range(len(times)) for j in range(i, len(times))), default=0.0)


def test_read_out_of_order_within_the_reorder_window_the_limit_holds_on_the_arrival_clock():
    # A failover: the new owner reads each band's backlog in turn (CRITICAL first), each spanning
    # the same few seconds of arrivals, at three times the tenant's rate of 4 a second, burst 2.
    import random

    rng = random.Random(3)
    adm, state = make(limits=[Limit("s", 1_000, requests=4, burst=2, over="refuse")]), TenantState()
    arrivals = sorted(NOW + rng.randrange(0, 6_000) for _ in range(72))
    bands = [arrivals[i::4] for i in range(4)]  # round-robin over four band topics
    admitted = [t for band in bands for t in band
                if adm.decide(req(prompt=str(t)), NOW + 6_000, state, arrived_ms=t).action is Action.DISPATCH]
    assert _worst_excess(admitted, 250) <= 2 + 1e-9
    assert len(admitted) >= 0.6 * 4 * 6  # refused for the limit, not for nothing
    # A refusal says how long from now (the buckets' clock), not from its old arrival.
    late = adm.decide(req(prompt="late"), NOW + 6_000, state, arrived_ms=NOW + 100)
    assert late.action is Action.REJECT and late.retry_after_ms <= 1_000


def test_over_a_delay_limit_a_burst_is_admitted_to_start_at_the_limits_pace():
    adm, state = make(limits=[Limit("s", 1_000, requests=10, burst=5)]), TenantState()
    decisions = [adm.decide(req(prompt=f"b{i}", timeout_ms=60_000), NOW, state, arrived_ms=NOW) for i in range(30)]
    assert all(d.action is Action.DISPATCH for d in decisions)
    starts = [d.not_before_ms or NOW for d in decisions]
    assert starts[:5] == [NOW] * 5  # the burst at once
    assert starts == sorted(starts)  # in order
    # Then one every 100 ms: no interval holds more than rate x interval + burst.
    assert [b - a for a, b in zip(starts[5:], starts[6:])] == [100] * 24
    for i, start in enumerate(starts):
        assert sum(1 for s in starts if start <= s < start + 1_000) <= 10 + 5
    assert any("shaped" in note for note in decisions[-1].notes) and decisions[-1].eta_ms >= 2_400


def test_a_delay_past_the_deadline_or_the_longest_delay_is_refused_with_retry_after():
    adm, state = make(limits=[Limit("s", 1_000, requests=1)]), TenantState()
    assert adm.decide(req(timeout_ms=60_000), NOW, state).action is Action.DISPATCH
    d = adm.decide(req(timeout_ms=500), NOW, state)  # would start in 1 s, its deadline is in 0.5 s
    assert d.action is Action.REJECT and d.reason.startswith("rate_limited") and d.retry_after_ms == 1_000
    adm.max_delay_ms = 2_000
    waits = [adm.decide(req(timeout_ms=60_000), NOW, state) for _ in range(4)]
    assert [d.action for d in waits] == [Action.DISPATCH, Action.DISPATCH, Action.REJECT, Action.REJECT]
    assert [d.not_before_ms - NOW for d in waits[:2]] == [1_000, 2_000]
