"""Weighted fair queuing by tokens (pipeline/policy/fair_queue.py): who gets the next slot."""

from __future__ import annotations

import collections

from pipeline.observability.fairness import jain
from pipeline.policy.fair_queue import OUTPUT_WEIGHT, FairQueue, Waiting, request_cost


def entry(tenant, item=None, *, partition=0, deadline=0.0, cost=1.0, not_before=0.0, nbytes=0) -> Waiting:
    return Waiting(item if item is not None else tenant, tenant, partition, deadline, cost, not_before, nbytes)


def serve(queue: FairQueue, slots: int, rounds: int, real_cost=None) -> collections.Counter:
    """Run ``rounds`` completions through ``slots`` slots; returns tokens served per tenant."""
    served: collections.Counter = collections.Counter()
    running = collections.deque()
    for _ in range(rounds):
        while len(running) < slots:
            e = queue.pop(0)
            if e is None:
                break
            running.append(e)
        if not running:
            break
        done = running.popleft()
        cost = real_cost(done) if real_cost else done.cost
        queue.settle(done.tenant, cost - done.cost)
        served[done.tenant] += cost
    return served


def test_cost_weighs_output_tokens_twice():
    assert OUTPUT_WEIGHT == 2.0
    assert request_cost(100, 50) == 200


def test_a_quiet_tenant_is_served_next_however_deep_the_flooders_backlog():
    q = FairQueue()
    for i in range(1000):
        q.push(entry("flooder", i, partition=3), 0)
    assert q.pop(0).tenant == "flooder"
    q.push(entry("quiet", "q", partition=3), 0)  # the same partition
    assert q.pop(0).item == "q"


def test_weights_two_to_one_share_served_tokens_two_to_one():
    q = FairQueue({"gold": 2.0, "plain": 1.0}.get)
    for i in range(3000):
        q.push(entry("gold", cost=10), 0)
        q.push(entry("plain", cost=10), 0)
    served = serve(q, 2, 1500)
    assert abs(served["gold"] / served["plain"] - 2.0) < 0.02


def test_long_answers_get_no_more_tokens_than_short_ones():
    # Charged the estimate at dispatch, corrected with the real usage at the end.
    q = FairQueue()
    for i in range(2000):
        q.push(entry("long", cost=request_cost(10, 64)), 0)
        q.push(entry("short", cost=request_cost(10, 64)), 0)
    real = {"long": request_cost(10, 640), "short": request_cost(10, 6)}
    served = serve(q, 4, 1500, real_cost=lambda e: real[e.tenant])
    assert abs(served["long"] / served["short"] - 1.0) < 0.1
    assert served["short"] > 0 and served["long"] > 0


def test_ten_backlogged_tenants_get_even_shares():
    q = FairQueue()
    for i in range(2000):
        for t in range(10):
            q.push(entry(f"t{t}", cost=5 + t * 7), 0)
    served = serve(q, 3, 2000)
    assert jain([served[f"t{t}"] for t in range(10)]) >= 0.99


def test_inside_a_tenant_earliest_deadline_first_then_arrival():
    q = FairQueue()
    q.push(entry("a", "late", deadline=900), 0)
    q.push(entry("a", "soon", deadline=100), 0)
    q.push(entry("a", "soon-too", deadline=100), 0)
    assert [q.pop(0).item for _ in range(3)] == ["soon", "soon-too", "late"]


def test_an_idle_tenant_saves_no_credit():
    q = FairQueue()
    for _ in range(100):
        q.push(entry("busy", cost=10), 0)
    for _ in range(50):
        q.pop(0)
    # "late" arrives after busy was served 50 times: it starts at the virtual time, not at 0,
    # so it alternates with busy instead of taking the next 50 slots.
    for _ in range(10):
        q.push(entry("late", cost=10), 0)
    picks = [q.pop(0).tenant for _ in range(10)]
    assert 4 <= picks.count("late") <= 6


def test_put_back_keeps_the_place_and_gives_the_charge_back():
    q = FairQueue()
    q.push(entry("a", "a1"), 0)
    q.push(entry("b", "b1"), 0)
    first = q.pop(0)
    before = q.counter(first.tenant)
    q.put_back(first)
    assert q.counter(first.tenant) == before - 1.0
    assert q.pop(0) is first
    # Made way for another tenant: given back only down to that tenant's counter, which goes first.
    q.push(entry("c", "c1"), 0)
    q.put_back(first, behind="c")
    assert q.counter(first.tenant) > q.counter("c")
    assert [q.pop(0).item for _ in range(3)] == ["b1", "c1", "a1"]
    charged = q.counter(first.tenant)
    q.put_back(first, refund=False)
    assert q.counter(first.tenant) == charged


def test_shaped_requests_wait_for_their_time_unseen():
    q = FairQueue()
    q.push(entry("a", "later", not_before=1_000), 0)
    q.push(entry("b", "now"), 0)
    assert q.size == 2 and q.ready == 1
    assert q.next_ready_at() == 1_000
    assert q.pop(500).item == "now"
    assert q.pop(500) is None and not q.has_ready(999)
    assert q.pop(1_000).item == "later"
    assert q.size == 0


def test_depth_and_bytes_per_partition_and_drop():
    q = FairQueue()
    for i in range(5):
        q.push(entry("a", partition="p0", nbytes=100), 0)
    q.push(entry("b", partition="p1", nbytes=10, not_before=50), 0)
    assert q.depth("p0") == 5 and q.partition_bytes("p0") == 500 and q.bytes == 510
    assert q.drop({"p0", "p1"}) == 6
    assert q.size == 0 and q.ready == 0 and q.bytes == 0 and q.pop(100) is None


def test_remove_last_takes_back_what_was_just_pushed():
    q = FairQueue()
    q.push(entry("a", "first"), 0)
    second = entry("a", "second")
    q.push(second, 0)
    assert q.remove_last() is second
    assert q.size == 1 and q.pop(0).item == "first" and q.pop(0) is None
