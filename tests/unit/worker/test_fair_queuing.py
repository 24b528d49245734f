"""Fair queuing in the worker: a free slot goes to the tenant owed it, by weight and tokens, whatever
partition its key hashed to; a request shaped by the gateway waits for its time.

Driven without a broker, as test_preemption: the backend's calls wait on events the test releases.
"""

from __future__ import annotations

import asyncio
import collections
import time

from pipeline.models import NOT_BEFORE_HEADER, Priority, Request, now_ms
from pipeline.testing import FakeMessage
from pipeline.worker.loop import Worker
from tests.unit.worker.test_preemption import CODEC, answers, make_worker, settle

NORMAL = Priority.NORMAL


def take(worker: Worker, tenant: str, partition: int, offsets: dict, headers=None, **kw) -> Request:
    request = Request.new(tenant, f"{tenant} prompt", priority=NORMAL, **kw)
    tp = (worker.settings.topics.request_topic(NORMAL), partition)
    offsets[tp] = offset = offsets.get(tp, -1) + 1
    worker.take(FakeMessage(tp[0], partition, offset, CODEC.encode_request(request), tenant.encode(), headers))
    return request


async def run_one_at_a_time(worker: Worker, n: int) -> list[str]:
    """Start and finish ``n`` calls one after another; the tenants in the order they started."""
    order = []
    for _ in range(n):
        assert worker.dispatch() == 1
        await settle()
        (running,) = [rid for rid in worker.backend.calls if rid not in worker.backend.gates
                      or not worker.backend.gates[rid].is_set()]
        order.append(running)
        worker.backend.release(running)
        await settle()
    return order


def test_a_quiet_tenant_on_the_flooders_partition_starts_at_the_next_free_slot():
    async def run():
        worker = make_worker(max_inflight=1, fair_preemption=False)
        offsets = {}
        flood = [take(worker, "flooder", 0, offsets) for _ in range(50)]
        quiet = take(worker, "quiet", 0, offsets)  # behind 50 of the flooder's in the same partition
        order = await run_one_at_a_time(worker, 3)
        assert order == [flood[0].request_id, quiet.request_id, flood[1].request_id]

    asyncio.run(run())


def test_weights_from_the_config_share_the_slots_two_to_one():
    async def run():
        worker = make_worker(max_inflight=1, tenant_weights={"gold": 2.0})
        offsets = {}
        tenant_of = {}
        for _ in range(40):
            for tenant in ("gold", "plain"):
                tenant_of[take(worker, tenant, 1, offsets).request_id] = tenant
        order = await run_one_at_a_time(worker, 30)
        counts = collections.Counter(tenant_of[rid] for rid in order)
        assert abs(counts["gold"] - 20) <= 1 and abs(counts["plain"] - 10) <= 1

    asyncio.run(run())


def test_weights_come_from_the_registry_unless_the_config_names_the_tenant():
    worker = make_worker(tenant_weights={"plain": 3.0})
    assert worker.scheduler.weight_of("plain") == 3.0 and worker.scheduler.weight_of("anyone") == 1.0
    s = worker.settings
    registered = Worker(s, worker.backend, worker_id="w2", weights={"gold": 4.0, "plain": 5.0}.get)
    assert registered.scheduler.weight_of("gold") == 4.0 and registered.scheduler.weight_of("plain") == 3.0


def test_a_request_shaped_by_the_gateway_starts_no_earlier_than_its_time():
    async def run():
        worker = make_worker(max_inflight=4)
        offsets = {}
        at = now_ms() + 150
        shaped = take(worker, "acme", 0, offsets, headers=[(NOT_BEFORE_HEADER, b"%d" % at)])
        assert worker.dispatch() == 0
        assert worker.scheduler.next_ready_at() == at
        other = take(worker, "other", 0, offsets)  # behind it in the partition, and ready: not held up
        assert worker.dispatch() == 1
        await settle()
        assert worker.backend.calls == [other.request_id]
        time.sleep(max(0.0, (at - now_ms()) / 1000) + 0.01)
        assert worker.dispatch() == 1
        await settle()
        assert worker.backend.calls[-1] == shaped.request_id
        for rid in worker.backend.calls:
            worker.backend.release(rid)
        await settle()
        assert len(answers(worker)) == 2

    asyncio.run(run())


def test_served_tokens_are_counted_per_tenant_and_the_fair_share_is_exported():
    async def run():
        worker = make_worker(max_inflight=1)
        offsets = {}
        for _ in range(10):
            take(worker, "a", 0, offsets)
            take(worker, "b", 1, offsets)
        await run_one_at_a_time(worker, 6)
        metrics = worker.metrics
        served = {labels[1]: child.value for labels, child in metrics.served_tokens.children.items()}
        assert served["a"] > 0 and served["a"] == served["b"]
        worker.fairness_tick()
        ratios = {labels[2]: child.value for labels, child in metrics.fair_share.children.items()}
        assert ratios == {"a": 1.0, "b": 1.0}
        assert metrics.fairness.labels(worker.metrics.pool, "NORMAL").value == 1.0
        for task in worker.running.values():
            task.cancel()
        await settle()

    asyncio.run(run())


def test_with_fair_queuing_off_a_band_is_served_in_deadline_order_whatever_the_tenant():
    async def run():
        worker = make_worker(max_inflight=1, fair_queuing=False, fair_preemption=False)
        offsets = {}
        flood = [take(worker, "flooder", 0, offsets) for _ in range(3)]
        quiet = take(worker, "quiet", 1, offsets)
        order = await run_one_at_a_time(worker, 4)
        assert order == [r.request_id for r in (*flood, quiet)]

    asyncio.run(run())


def test_a_not_before_past_the_deadline_holds_the_request_only_until_its_deadline():
    async def run():
        worker = make_worker(max_inflight=4)
        offsets = {}
        late = take(worker, "acme", 0, offsets, headers=[(NOT_BEFORE_HEADER, b"%d" % (now_ms() + 3_600_000))],
                    timeout_ms=100)
        assert worker.dispatch() == 0
        time.sleep(0.15)
        worker.dispatch()
        await settle()
        (answer,) = answers(worker)
        assert answer.request_id == late.request_id and answer.status.value == "EXPIRED"

    asyncio.run(run())
