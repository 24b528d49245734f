"""The gateway consumer's inline delivery of fetched messages (pipeline.gateway.faust_fixes)."""

import asyncio

import pytest
from faust.transport.drivers import aiokafka as faust_aiokafka

from pipeline.gateway.faust_fixes import _ShortFetchConsumer


@pytest.fixture
def consumer(monkeypatch):
    """A consumer with just the state wait_first reads; faust's own wait_first recorded."""
    fallbacks = []

    async def faust_wait_first(self, *coros, timeout=None):
        fallbacks.append(coros)
        try:
            return await coros[0]
        finally:
            for other in coros[1:]:
                other.close()

    monkeypatch.setattr(faust_aiokafka.Consumer, "wait_first", faust_wait_first)
    c = object.__new__(_ShortFetchConsumer)
    c.suspend_flow = asyncio.Event()
    c.fallbacks = fallbacks
    return c


def test_a_delivery_that_need_not_wait_runs_inline(consumer):
    delivered = []

    async def deliver(n):
        delivered.append(n)

    async def main():
        for n in range(3):
            assert await consumer.wait_first(deliver(n), consumer.suspend_flow.wait()) is None

    asyncio.run(main())
    assert delivered == [0, 1, 2]
    assert consumer.fallbacks == []


def test_a_delivery_that_waits_is_finished_by_faust_s_path_in_order(consumer):
    steps = []

    async def main():
        room = asyncio.get_running_loop().create_future()

        async def deliver():
            steps.append("started")
            steps.append(await room)  # a full queue: waits for room
            steps.append("put")
            return "done"

        asyncio.get_running_loop().call_later(0.01, room.set_result, "room")
        return await consumer.wait_first(deliver(), consumer.suspend_flow.wait())

    assert asyncio.run(main()) == "done"
    assert steps == ["started", "room", "put"]  # started once, not again by the fallback
    assert len(consumer.fallbacks) == 1


def test_a_delivery_that_waits_can_still_be_cancelled(consumer):
    async def main():
        never = asyncio.get_running_loop().create_future()

        async def deliver():
            await never

        task = asyncio.ensure_future(consumer.wait_first(deliver(), consumer.suspend_flow.wait()))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_while_flow_is_suspended_faust_s_own_path_is_taken(consumer):
    delivered = []

    async def deliver():
        delivered.append(1)

    async def main():
        consumer.suspend_flow.set()
        await consumer.wait_first(deliver(), consumer.suspend_flow.wait())

    asyncio.run(main())
    assert delivered == [1]
    assert len(consumer.fallbacks) == 1


def test_an_error_in_delivery_reaches_the_fetcher(consumer):
    async def deliver():
        raise ValueError("undecodable")

    async def main():
        await consumer.wait_first(deliver(), consumer.suspend_flow.wait())

    with pytest.raises(ValueError, match="undecodable"):
        asyncio.run(main())
