"""Fairness between tenants inside a band (worker.fair_preemption): a request whose tenant runs
no call in its band takes the slot of a tenant running two or more there.

Driven without a broker, as test_preemption: the backend's calls wait on events the test
releases. Messages are keyed by tenant, as the gateway and the llmq client key them.
"""

from __future__ import annotations

import asyncio

from pipeline.models import Priority, Request, Status
from pipeline.testing import FakeMessage
from pipeline.worker.loop import Worker
from tests.unit.worker.test_preemption import CODEC, answers, make_worker, settle

NORMAL = Priority.NORMAL


def take(worker: Worker, tenant: str, partition: int, offsets: dict, band: Priority = NORMAL,
         key: bytes | None = b"") -> Request:
    request = Request.new(tenant, f"{tenant} prompt", priority=band)
    tp = (worker.settings.topics.request_topic(band), partition)
    offsets[tp] = offset = offsets.get(tp, -1) + 1
    worker.take(FakeMessage(tp[0], partition, offset, CODEC.encode_request(request),
                             tenant.encode() if key == b"" else key))
    return request


def stop_all(worker: Worker):
    for task in worker.running.values():
        task.cancel()
    return settle()


async def flooder_in_every_slot(**worker_settings) -> tuple[Worker, dict, Request, Request]:
    """A two-slot worker running two NORMAL calls of tenant "flooder" (partition 1)."""
    worker = make_worker(max_inflight=2, **worker_settings)
    offsets = {}
    first, second = take(worker, "flooder", 1, offsets), take(worker, "flooder", 1, offsets)
    assert worker.dispatch() == 2
    await settle()
    return worker, offsets, first, second


def test_a_quiet_tenant_takes_the_slot_of_a_tenant_holding_every_slot_and_the_call_runs_again_after():
    async def run():
        worker, offsets, first, second = await flooder_in_every_slot()
        backend = worker.backend
        quiet = take(worker, "quiet", 2, offsets)
        assert worker.dispatch() == 1
        await settle()
        assert backend.cancelled == [second.request_id]  # the flooder's latest call
        assert backend.calls[-1] == quiet.request_id
        assert worker.stats.preempted == worker.stats.preempted_in_band == 1
        assert worker.metrics.preemptions.labels("NORMAL").value == 1
        # The flooder's request waits behind the one it made way for, and runs when a slot frees.
        assert worker.scheduler.queues[NORMAL.rank].size == 1
        backend.release(quiet.request_id)
        await settle()
        assert worker.dispatch() == 1
        await settle()
        assert backend.calls[-1] == second.request_id
        backend.release(first.request_id)
        backend.release(second.request_id)
        await settle()
        got = answers(worker)
        assert sorted(r.request_id for r in got) == sorted([first.request_id, second.request_id, quiet.request_id])
        assert all(r.status is Status.COMPLETED for r in got)  # one answer each
        flooder_tp = (worker.settings.topics.request_topic(NORMAL), 1)
        assert dict(worker.checkpoint.tracker.to_commit()).get(flooder_tp) == 2
        assert not worker.running and not worker.scheduler.by_tenant and not worker.scheduler.tenant_of_call
        assert worker.scheduler.crowded == 0

    asyncio.run(run())


def test_the_preempted_call_does_not_jump_ahead_of_the_request_it_made_way_for():
    # The flooder's partition had nothing else queued: put back first in line, it would be
    # taken again in the quiet tenant's place.
    async def run():
        worker, offsets, _, _ = await flooder_in_every_slot()
        quiet = take(worker, "quiet", 2, offsets)
        worker.dispatch()
        await settle()
        assert worker.backend.calls[-1] == quiet.request_id
        assert worker.scheduler.crowded == 0  # the flooder runs one call now, the quiet tenant one
        await stop_all(worker)

    asyncio.run(run())


def _nothing_preempted(worker: Worker, running: list[tuple[str, int]], waiting: list[tuple[str, int]],
                       key: bytes | None = b"") -> None:
    async def run():
        offsets = {}
        for tenant, partition in running:
            take(worker, tenant, partition, offsets, key=key)
        assert worker.dispatch() == len(running)
        await settle()
        for tenant, partition in waiting:
            take(worker, tenant, partition, offsets, key=key)
        assert worker.dispatch() == 0
        assert worker.backend.cancelled == [] and worker.stats.preempted == 0
        await stop_all(worker)

    asyncio.run(run())


def test_a_tenant_already_running_a_call_in_the_band_waits_its_turn():
    _nothing_preempted(make_worker(max_inflight=3), [("flooder", 1), ("flooder", 1), ("quiet", 2)], [("quiet", 2)])


def test_no_preemption_while_every_tenant_runs_a_single_call():
    _nothing_preempted(make_worker(max_inflight=2), [("a", 1), ("b", 2)], [("c", 3)])


def test_a_call_from_the_waiting_requests_own_partition_is_not_taken():
    _nothing_preempted(make_worker(max_inflight=2), [("flooder", 1), ("flooder", 1)], [("quiet", 1)])


def test_messages_without_a_key_are_told_apart_by_their_requests_tenant():
    # The tenant is the request's tenant_id, not the message key (any Kafka client may write requests).
    async def run():
        worker = make_worker(max_inflight=2)
        offsets = {}
        take(worker, "flooder", 1, offsets, key=None)
        take(worker, "flooder", 1, offsets, key=None)
        assert worker.dispatch() == 2
        await settle()
        take(worker, "quiet", 2, offsets, key=None)
        assert worker.dispatch() == 1
        await settle()
        assert worker.stats.preempted_in_band == 1
        await stop_all(worker)

    asyncio.run(run())


def test_fair_preemption_off_keeps_every_running_call():
    worker = make_worker(env={"LLMQ_WORKER__FAIR_PREEMPTION": "false"}, max_inflight=2)
    assert worker.cfg.fair_preemption is False
    _nothing_preempted(worker, [("flooder", 1), ("flooder", 1)], [("quiet", 2)])


def test_fairness_never_preempts_across_bands():
    # A NORMAL flooder holding both slots is not preempted for a LOW request of another
    # tenant: band order comes first (LOW is preemptible, NORMAL is not).
    async def run():
        worker, offsets, _, _ = await flooder_in_every_slot()
        take(worker, "quiet", 2, offsets, band=Priority.LOW)
        assert worker.dispatch() == 0 and worker.stats.preempted == 0
        await stop_all(worker)

    asyncio.run(run())


def test_a_request_is_preempted_for_fairness_at_most_max_preemptions_times():
    async def run():
        worker, offsets, first, victim = await flooder_in_every_slot(max_preemptions=1)
        backend = worker.backend
        quiet = take(worker, "quiet", 2, offsets)
        assert worker.dispatch() == 1
        await settle()
        backend.release(quiet.request_id)
        await settle()
        assert worker.dispatch() == 1  # the victim runs again
        await settle()
        assert backend.calls[-1] == victim.request_id
        take(worker, "other", 3, offsets)
        assert worker.dispatch() == 1
        await settle()
        # Preempted once already, the latest-started call keeps its slot: the older one gives way.
        assert backend.cancelled == [victim.request_id, first.request_id]
        await stop_all(worker)

    asyncio.run(run())


def test_revoking_a_partition_forgets_its_tenants_calls():
    async def run():
        worker, _, _, _ = await flooder_in_every_slot()
        assert worker.scheduler.crowded == 1
        worker.scheduler.drop({(worker.settings.topics.request_topic(NORMAL), 1)})
        assert worker.scheduler.crowded == 0 and not worker.scheduler.by_tenant and not worker.scheduler.tenant_of_call
        await stop_all(worker)

    asyncio.run(run())


def test_a_tenant_holding_no_more_than_its_weighted_share_keeps_its_slots():
    # Weight 2 against 1: two of the two slots is its share (rounded up), so nothing gives way.
    _nothing_preempted(make_worker(max_inflight=2, tenant_weights={"gold": 2.0}), [("gold", 1), ("gold", 1)],
                       [("plain", 2)])
