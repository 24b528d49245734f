"""The worker starts only as many calls as the backend's servers can start now; the rest wait in
llmq's band queues, in priority order, where preemption applies.

Driven without a broker: the fake producer acknowledges at once. The backend is a stand-in
for a paced OpenAIBackend: servers with a fixed number of slots per model, calls that wait
on events the test releases.
"""

from __future__ import annotations

import asyncio

from pipeline.config import Settings
from pipeline.errors import BackendError
from pipeline.models import Priority, Request, Status
from pipeline.serde import Codec
from pipeline.testing import FakeMessage
from pipeline.worker.backends.base import Completion
from pipeline.worker.backends.routing import RoutingTable, UnknownModelError
from pipeline.worker.loop import Worker
from tests.unit.worker.test_admission_fuzz import FakeProducer

CODEC = Codec.default()


class SlotBackend:
    """``slots``: server name → slots; ``models``: model → its server. A call holds its
    reserved slot until the test releases its request id."""

    name = "slots"

    def __init__(self, slots: dict[str, int], models: dict[str, str]):
        self.slots = dict(slots)
        self.models = dict(models)
        self.used = {server: 0 for server in slots}
        self.gates: dict[str, asyncio.Event] = {}
        self.calls: list[str] = []
        self.cancelled: list[str] = []
        self.reserved = 0

    def complete_now(self, request):
        return None

    def room(self) -> int:
        return sum(self.slots[s] - self.used[s] for s in self.slots)

    def reserve(self, request):
        server = self.models.get(request.model)
        if server is None:
            raise UnknownModelError(request.model, self.models)
        if self.used[server] >= self.slots[server]:
            return None
        self.used[server] += 1
        self.reserved += 1
        return {"server": server, "released": False}

    def release(self, slot) -> None:
        if not slot["released"]:
            slot["released"] = True
            self.used[slot["server"]] -= 1

    def same_servers(self, model: str, other: str) -> bool:
        return self.models.get(model) == self.models.get(other)

    async def complete(self, request, reserved=None):
        assert reserved is not None, "a paced backend's call always has its slot"
        self.calls.append(request.request_id)
        try:
            await self.gates.setdefault(request.request_id, asyncio.Event()).wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.release(reserved)
        return Completion(f"answer to {request.prompt}", 1, 1, request.model)

    def finish(self, request_id: str) -> None:
        self.gates.setdefault(request_id, asyncio.Event()).set()

    async def close(self):
        return None


def make_worker(backend, **worker) -> Worker:
    s = Settings.load(env={})
    for name, value in worker.items():
        setattr(s.worker, name, value)
    w = Worker(s, backend, worker_id="room-worker")
    w.session.producer = FakeProducer()
    return w


class Feed:
    def __init__(self, worker: Worker):
        self.worker = worker
        self.offsets: dict[Priority, int] = {}

    def take(self, priority: Priority, model: str = "m", tenant: str = "t", partition: int = 0,
             **fields) -> Request:
        request = Request.new(tenant, f"{priority.value} prompt", priority=priority, model=model, **fields)
        offset = self.offsets.get((priority, partition), 0)
        self.offsets[(priority, partition)] = offset + 1
        topic = self.worker.settings.topics.request_topic(priority)
        self.worker.take(FakeMessage(topic, partition, offset, CODEC.encode_request(request), tenant.encode()))
        return request


def answers(worker: Worker) -> list:
    return [CODEC.decode_response(m.value()) for m in worker.producer.sent if m.topic() == worker.responses_topic]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_no_more_calls_start_than_the_servers_have_room_for_and_the_rest_wait_in_band_order():
    async def run():
        backend = SlotBackend({"a": 2}, {"m": "a"})
        worker = make_worker(backend, max_inflight=64, preempt_bands=[])
        feed = Feed(worker)
        background = [feed.take(Priority.BACKGROUND) for _ in range(5)]
        assert worker.dispatch() == 2
        await settle()
        assert backend.calls == [r.request_id for r in background[:2]]
        assert worker.scheduler.queues[Priority.BACKGROUND.rank].size == 3  # waiting here, not at the server
        urgent = feed.take(Priority.CRITICAL)
        assert worker.dispatch() == 0  # no room, and BACKGROUND is not preemptible here
        backend.finish(background[0].request_id)
        await settle()
        assert worker.dispatch() == 1
        await settle()
        assert backend.calls[-1] == urgent.request_id  # the freed slot went to the higher band
        for request_id in list(backend.calls):
            backend.finish(request_id)
        while worker.running or worker.scheduler.queues[Priority.BACKGROUND.rank].size:
            worker.dispatch()
            for request_id in list(backend.calls):
                backend.finish(request_id)
            await settle()
        got = answers(worker)
        assert len(got) == 6 and all(r.status is Status.COMPLETED for r in got)
        assert len({r.request_id for r in got}) == 6
        assert backend.used == {"a": 0}

    asyncio.run(run())


def test_max_inflight_still_bounds_a_backend_with_more_room():
    async def run():
        backend = SlotBackend({"a": 10}, {"m": "a"})
        worker = make_worker(backend, max_inflight=3)
        feed = Feed(worker)
        for _ in range(5):
            feed.take(Priority.NORMAL)
        assert worker.dispatch() == 3
        await settle()
        assert backend.used == {"a": 3}
        for task in worker.running.values():
            task.cancel()
        await settle()
        assert backend.used == {"a": 0}

    asyncio.run(run())


def test_a_model_without_a_server_is_failed_at_once_without_a_call():
    async def run():
        backend = SlotBackend({"a": 2}, {"m": "a"})
        worker = make_worker(backend)
        feed = Feed(worker)
        lost = feed.take(Priority.HIGH, model="no-such-model")
        assert worker.dispatch() == 1  # taken, and answered
        await settle()
        (response,) = answers(worker)
        assert response.request_id == lost.request_id and response.status is Status.FAILED
        assert response.reason == "model_unavailable: no server for model no-such-model"
        assert backend.calls == [] and worker.stats.failed == 1
        assert worker.checkpoint.tracker.to_commit() == [((worker.settings.topics.request_topic(Priority.HIGH), 0), 1)]

    asyncio.run(run())


def test_a_request_whose_servers_are_full_waits_in_its_queue_while_another_models_request_starts():
    async def run():
        backend = SlotBackend({"a": 1, "b": 1}, {"big": "a", "small": "b"})
        worker = make_worker(backend, preempt_bands=[])
        feed = Feed(worker)
        first = feed.take(Priority.NORMAL, model="big", tenant="t1")
        assert worker.dispatch() == 1
        await settle()
        blocked = feed.take(Priority.NORMAL, model="big", tenant="t1")
        other = feed.take(Priority.NORMAL, model="small", tenant="t2", partition=1)
        assert worker.dispatch() == 1
        await settle()
        assert backend.calls == [first.request_id, other.request_id]
        assert worker.scheduler.queues[Priority.NORMAL.rank].size == 1  # still queued here
        # Taken again and again while its server is full, it is decoded once, and counted as
        # consumed once it runs.
        decoded = []
        decode = worker.processor.codec.decode_request
        worker.processor.codec = type("Counting", (), {"decode_request": lambda self, v: decoded.append(v) or
                                                       decode(v)})()
        for _ in range(3):
            assert worker.dispatch() == 0
        assert decoded == [] and worker.stats.consumed == 2
        backend.finish(first.request_id)
        await settle()
        assert worker.dispatch() == 1
        await settle()
        assert backend.calls[-1] == blocked.request_id and worker.stats.consumed == 3
        for request_id in (other.request_id, blocked.request_id):
            backend.finish(request_id)
        await settle()
        assert [r.request_id for r in answers(worker)] == [first.request_id, other.request_id, blocked.request_id]
        waits = worker.metrics.queue_wait.labels("NORMAL")
        assert sum(waits.counts) == 3  # each request's wait observed once, when it started

    asyncio.run(run())


def test_a_critical_request_preempts_one_background_call_when_the_servers_are_full():
    async def run():
        backend = SlotBackend({"a": 2}, {"m": "a"})
        worker = make_worker(backend, max_inflight=64)
        feed = Feed(worker)
        slow = [feed.take(Priority.BACKGROUND) for _ in range(2)]
        assert worker.dispatch() == 2
        await settle()
        urgent = feed.take(Priority.CRITICAL)
        worker.dispatch()  # one call gives way; its slot is free once its cancellation ran
        assert worker.stats.preempted == 1
        await settle()
        worker.dispatch()
        await settle()
        assert backend.cancelled == [slow[1].request_id]  # the latest started, and only that one
        assert backend.calls[-1] == urgent.request_id
        assert backend.used == {"a": 2}
        backend.finish(urgent.request_id)
        backend.finish(slow[0].request_id)
        await settle()
        worker.dispatch()
        await settle()
        backend.finish(slow[1].request_id)
        await settle()
        got = answers(worker)
        assert [r.request_id for r in got] == [urgent.request_id, slow[0].request_id, slow[1].request_id]

    asyncio.run(run())


def test_preemption_for_a_full_model_only_cancels_a_call_on_that_models_servers():
    async def run():
        backend = SlotBackend({"a": 1, "b": 2}, {"big": "a", "small": "b"})
        worker = make_worker(backend)
        feed = Feed(worker)
        on_a = feed.take(Priority.BACKGROUND, model="big", tenant="t1")
        on_b = feed.take(Priority.BACKGROUND, model="small", tenant="t2")
        assert worker.dispatch() == 2
        await settle()
        urgent = feed.take(Priority.CRITICAL, model="big", tenant="t3")
        worker.dispatch()
        await settle()
        worker.dispatch()
        await settle()
        assert backend.cancelled == [on_a.request_id]  # not the later call on the other model's server
        assert backend.calls[-1] == urgent.request_id
        for request_id in (urgent.request_id, on_b.request_id):
            backend.finish(request_id)
        await settle()
        for task in worker.running.values():
            task.cancel()
        await settle()

    asyncio.run(run())


def test_a_reserved_slot_is_given_back_when_its_call_is_cancelled_before_it_ran():
    async def run():
        backend = SlotBackend({"a": 2}, {"m": "a"})
        worker = make_worker(backend)
        feed = Feed(worker)
        feed.take(Priority.NORMAL)
        assert worker.dispatch() == 1
        assert backend.used == {"a": 1}
        for task in worker.running.values():
            task.cancel()  # before its first step: none of its code runs
        await settle()
        assert backend.used == {"a": 0} and backend.calls == []

    asyncio.run(run())


def test_an_openai_backend_routes_a_degraded_request_to_its_own_models_servers():
    from pipeline.worker.backends.openai_http import OpenAIBackend

    routes = RoutingTable.parse("big=http://127.0.0.1:9/v1;small=http://127.0.0.1:10/v1")
    backend = OpenAIBackend(routes=routes)
    try:
        degraded = Request.new("t", "hi", model="small", degraded_from="big")
        slot = backend.reserve(degraded)
        assert slot.server.base_url == "http://127.0.0.1:10/v1"
        assert backend.capacity("big") == 4 and backend.capacity("small") == 3
        backend.release(slot)
        backend.release(slot)  # idempotent
        assert backend.capacity("small") == 4
        try:
            backend.reserve(Request.new("t", "hi", model="other"))
        except UnknownModelError as exc:
            assert not exc.retriable and isinstance(exc, BackendError)
        else:
            raise AssertionError("a model with no route must be refused")
        assert backend.same_servers("big", "big") and not backend.same_servers("big", "small")
        # Reserved until no server of the model has room.
        slots = [backend.reserve(degraded) for _ in range(4)]
        assert all(slots) and backend.reserve(degraded) is None and backend.room() == 4
    finally:
        asyncio.run(backend.close())


def test_a_lower_band_request_for_a_model_with_room_starts_while_a_higher_one_waits_for_its_servers():
    async def run():
        backend = SlotBackend({"a": 1, "b": 1}, {"big": "a", "small": "b"})
        worker = make_worker(backend, preempt_bands=[])
        feed = Feed(worker)
        running = feed.take(Priority.NORMAL, model="big", tenant="t1")
        assert worker.dispatch() == 1
        await settle()
        waiting = feed.take(Priority.CRITICAL, model="big", tenant="t2")
        later = feed.take(Priority.BACKGROUND, model="small", tenant="t3")
        assert worker.dispatch() == 1  # one free slot, on b: the BACKGROUND request takes it
        await settle()
        assert backend.calls == [running.request_id, later.request_id]
        assert worker.scheduler.queues[Priority.CRITICAL.rank].size == 1
        backend.finish(running.request_id)
        await settle()
        assert worker.dispatch() == 1
        await settle()
        assert backend.calls[-1] == waiting.request_id
        for task in worker.running.values():
            task.cancel()
        await settle()

    asyncio.run(run())
