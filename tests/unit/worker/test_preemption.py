"""A request of a higher band takes the slot of a running call of a preemptible band.

Driven without a broker: the fake producer acknowledges at once. The backend's calls wait on
events the test releases, so which call is running when is under the test's control.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline.config import Settings
from pipeline.errors import ConfigError
from pipeline.models import Priority, Request, Status
from pipeline.serde import Codec
from pipeline.testing import FakeMessage
from pipeline.worker.backends.simulated import SimulatedBackend
from pipeline.worker.loop import Worker
from tests.unit.worker.test_admission_fuzz import FakeProducer

CODEC = Codec.default()


class GatedBackend(SimulatedBackend):
    """Every call waits until the test releases its request id."""

    def __init__(self):
        super().__init__()
        self.gates: dict[str, asyncio.Event] = {}
        self.calls: list[str] = []
        self.cancelled: list[str] = []

    def complete_now(self, request):
        return None

    async def complete(self, request):
        self.calls.append(request.request_id)
        gate = self.gates.setdefault(request.request_id, asyncio.Event())
        try:
            await gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        return self.answer(request)

    def release(self, request_id: str) -> None:
        self.gates.setdefault(request_id, asyncio.Event()).set()


def make_worker(env: dict | None = None, **worker) -> Worker:
    s = Settings.load(env=env or {})
    for name, value in worker.items():
        setattr(s.worker, name, value)
    w = Worker(s, GatedBackend(), worker_id="preempt-worker")
    w.session.producer = FakeProducer()
    return w


class Feed:
    def __init__(self, worker: Worker):
        self.worker = worker
        self.offsets: dict[Priority, int] = {}

    def take(self, priority: Priority, tenant: str = "t") -> Request:
        request = Request.new(tenant, f"{priority.value} prompt", priority=priority)
        offset = self.offsets.get(priority, 0)
        self.offsets[priority] = offset + 1
        topic = self.worker.settings.topics.request_topic(priority)
        self.worker.take(FakeMessage(topic, 0, offset, CODEC.encode_request(request), tenant.encode()))
        return request


def answers(worker: Worker) -> list:
    return [CODEC.decode_response(m.value()) for m in worker.producer.sent if m.topic() == worker.responses_topic]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def assert_nothing_preempted(worker: Worker, running: list[Priority], waiting: list[Priority],
                             preemptible_running: int | None = None) -> None:
    """Requests of ``running`` take every slot, then requests of ``waiting`` arrive: none of the
    running calls gives way (``preemptible_running``: how many of them were preemptible)."""
    async def run():
        feed = Feed(worker)
        for band in running:
            feed.take(band)
        assert worker.dispatch() == len(running)
        await settle()
        if preemptible_running is not None:
            assert len(worker.scheduler.victims) == preemptible_running
        for band in waiting:
            feed.take(band)
        assert worker.dispatch() == 0
        assert worker.backend.cancelled == [] and worker.stats.preempted == 0
        for task in worker.running.values():
            task.cancel()
        await settle()

    asyncio.run(run())


def test_a_critical_request_takes_the_slot_of_the_latest_background_call_which_runs_again_later():
    async def run():
        worker = make_worker(max_inflight=2)
        backend, feed = worker.backend, Feed(worker)
        first, second = feed.take(Priority.BACKGROUND), feed.take(Priority.BACKGROUND)
        assert worker.dispatch() == 2
        await settle()
        urgent = feed.take(Priority.CRITICAL)
        assert worker.dispatch() == 1
        await settle()
        # The most recently started call gave way; the older one keeps running.
        assert backend.cancelled == [second.request_id]
        assert backend.calls[-1] == urgent.request_id
        assert worker.stats.preempted == 1
        assert worker.metrics.preemptions.labels("BACKGROUND").value == 1
        # Its offset holds the partition's commits back while it waits to run again.
        background_tp = (worker.settings.topics.request_topic(Priority.BACKGROUND), 0)
        assert worker.scheduler.queues[Priority.BACKGROUND.rank].size == 1
        backend.release(urgent.request_id)
        backend.release(first.request_id)
        await settle()
        assert dict(worker.checkpoint.tracker.to_commit()).get(background_tp) == 1
        assert worker.dispatch() == 1  # a slot is free: the preempted request runs again
        await settle()
        backend.release(second.request_id)
        await settle()
        got = answers(worker)
        assert [r.request_id for r in got] == [urgent.request_id, first.request_id, second.request_id]
        assert all(r.status == Status.COMPLETED for r in got)  # one answer each, no duplicate rejection
        assert dict(worker.checkpoint.tracker.to_commit()).get(background_tp) == 2
        assert not worker.running and not worker.scheduler.victims and not worker.scheduler.preempt_counts
        assert worker.stats.consumed == 3
        waits = worker.metrics.queue_wait.labels("BACKGROUND")
        assert sum(waits.counts) == 2  # the preempted request's wait observed once, at its first start

    asyncio.run(run())


def test_a_request_preempts_only_once_it_has_waited_preempt_after_ms_for_a_slot_to_free():
    async def run():
        worker = make_worker(max_inflight=1, preempt_after_ms=80)
        backend, feed = worker.backend, Feed(worker)
        slow = feed.take(Priority.BACKGROUND)
        assert worker.dispatch() == 1
        await settle()
        urgent = feed.take(Priority.CRITICAL)
        assert worker.dispatch() == 0 and worker.stats.preempted == 0  # a slot may yet free on its own
        await asyncio.sleep(0.1)
        assert worker.dispatch() == 1 and worker.stats.preempted == 1
        await settle()
        assert backend.cancelled == [slow.request_id] and backend.calls[-1] == urgent.request_id
        for request_id in (urgent.request_id, slow.request_id):
            backend.release(request_id)
        await settle()

    asyncio.run(run())


def test_a_slot_that_frees_within_preempt_after_ms_goes_to_the_waiting_request_without_a_preemption():
    async def run():
        worker = make_worker(max_inflight=1, preempt_after_ms=10_000)
        backend, feed = worker.backend, Feed(worker)
        slow = feed.take(Priority.BACKGROUND)
        worker.dispatch()
        await settle()
        urgent = feed.take(Priority.CRITICAL)
        assert worker.dispatch() == 0
        backend.release(slow.request_id)
        await settle()
        assert worker.dispatch() == 1 and worker.stats.preempted == 0 and backend.cancelled == []
        backend.release(urgent.request_id)
        await settle()
        assert [r.request_id for r in answers(worker)] == [slow.request_id, urgent.request_id]

    asyncio.run(run())


def test_bands_not_listed_as_preemptible_keep_their_slots():
    # preempt_bands: LOW and BACKGROUND by default
    assert_nothing_preempted(make_worker(max_inflight=1), [Priority.NORMAL], [Priority.CRITICAL])


def test_a_request_never_preempts_its_own_band_or_a_higher_one():
    worker = make_worker(max_inflight=1, preempt_bands=["NORMAL", "LOW", "BACKGROUND"])
    assert_nothing_preempted(worker, [Priority.LOW], [Priority.LOW, Priority.BACKGROUND])


def test_a_request_is_preempted_at_most_max_preemptions_times():
    async def run():
        worker = make_worker(max_inflight=1, max_preemptions=2)
        backend, feed = worker.backend, Feed(worker)
        victim = feed.take(Priority.BACKGROUND)
        for round_ in range(3):
            assert worker.dispatch() == 1  # the BACKGROUND request (again)
            await settle()
            urgent = feed.take(Priority.HIGH)
            started = worker.dispatch()
            await settle()
            if round_ < 2:
                assert started == 1 and backend.cancelled.count(victim.request_id) == round_ + 1
                backend.release(urgent.request_id)
                await settle()
            else:  # its third run is left to finish
                assert started == 0 and backend.cancelled.count(victim.request_id) == 2
        backend.release(victim.request_id)
        await settle()
        worker.dispatch()
        await settle()
        backend.release(urgent.request_id)
        await settle()
        got = [r.request_id for r in answers(worker)]
        assert got.count(victim.request_id) == 1 and len(got) == 4

    asyncio.run(run())


def test_no_preemption_when_the_lower_band_is_owed_its_minimum_share():
    worker = make_worker(max_inflight=1)
    # The recent dispatches were all CRITICAL: BACKGROUND is below its 5 % minimum share, so the
    # scheduler serves it next, and a waiting CRITICAL request does not cancel it.
    worker.scheduler.bands.record_many(Priority.CRITICAL.rank, 100)
    assert_nothing_preempted(worker, [Priority.BACKGROUND], [Priority.CRITICAL, Priority.BACKGROUND])


def test_a_call_started_on_its_bands_minimum_share_is_not_preempted_afterwards():
    worker = make_worker(max_inflight=2)
    worker.scheduler.bands.record_many(Priority.CRITICAL.rank, 100)
    # BACKGROUND starts first (owed its share), then CRITICAL; another CRITICAL then waits.
    assert_nothing_preempted(worker, [Priority.CRITICAL, Priority.BACKGROUND], [Priority.CRITICAL],
                             preemptible_running=0)


def test_an_empty_preempt_bands_turns_preemption_off():
    worker = make_worker(env={"LLMQ_WORKER__PREEMPT_BANDS": ""}, max_inflight=1)
    assert worker.cfg.preempt_bands == []
    assert_nothing_preempted(worker, [Priority.BACKGROUND], [Priority.CRITICAL])


def test_revoking_a_partition_forgets_its_preemptible_calls():
    async def run():
        worker = make_worker(max_inflight=2)
        feed = Feed(worker)
        feed.take(Priority.BACKGROUND)
        worker.dispatch()
        await settle()
        assert worker.scheduler.victims
        worker.scheduler.drop({(worker.settings.topics.request_topic(Priority.BACKGROUND), 0)})
        assert not worker.scheduler.victims
        for task in worker.running.values():
            task.cancel()
        await settle()

    asyncio.run(run())


@pytest.mark.parametrize("bands, message", [(["URGENT"], "unknown band 'URGENT'"),
                                            (["CRITICAL"], "no higher band")])
def test_preempt_bands_are_checked_at_start(bands, message):
    s = Settings.load(env={})
    s.worker.preempt_bands = bands
    with pytest.raises(ConfigError, match="worker.preempt_bands") as info:
        s.validate()
    assert message in str(info.value)


@pytest.mark.parametrize("pool, preemptible", [("all", {"LOW", "BACKGROUND"}), ("async", {"LOW"}),
                                               ("background", set()), ("realtime", set())])
def test_only_bands_below_one_the_pool_consumes_are_preemptible(pool, preemptible):
    worker = make_worker(pool=pool)
    assert {p.value for p in Priority if p.rank in worker.scheduler.preemptible} == preemptible


@pytest.mark.parametrize("source", ["requests", "dispatch"])
def test_a_message_waits_in_the_band_of_its_topic_whichever_the_source(source):
    worker = make_worker(source=source, pool="all")
    topics = worker.settings.topics
    for band in Priority:
        topic = (topics.dispatch_topic if source == "dispatch" else topics.request_topic)(band)
        assert topic in worker.topics
        worker.scheduler.add((topic, 0), FakeMessage(topic, 0, 0, b"x", b"t"), Request.new("t", "p", priority=band))
        assert worker.scheduler.queues[band.rank].size == 1
    assert {p.value for p in Priority if p.rank in worker.scheduler.preemptible} == {"LOW", "BACKGROUND"}


def test_a_dead_letter_is_counted_under_its_topics_band_dispatch_topics_too():
    worker = make_worker(source="dispatch")
    topic = worker.settings.topics.dispatch_topic(Priority.HIGH)
    worker.handle(FakeMessage(topic, 0, 0, b"\x00not a request"))
    assert worker.metrics.requests.labels("HIGH", "dead_lettered").value == 1
    assert worker.producer.sent[-1].topic() == worker.dlq_topic
