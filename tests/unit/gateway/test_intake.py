"""How the gateway's agents batch their events (pipeline.gateway.app._Intake)."""

import asyncio
from types import SimpleNamespace

from pipeline.gateway.app import _Intake


class FakeStream:
    """What _Intake reads of a faust stream: events from a queue, one at a time."""

    def __init__(self):
        self.enable_acks = True
        self.active = True
        self.queue = asyncio.Queue()
        self.channel = SimpleNamespace(queue=self.queue)
        self.app = SimpleNamespace(flow_control=SimpleNamespace(is_active=lambda: self.active))
        self.current_event = None

    async def __aiter__(self):
        while True:
            await asyncio.sleep(0)  # as faust's stream iterator does before each event
            self.current_event = await self.queue.get()
            yield self.current_event


def _run(scenario):
    async def main():
        stream, batches = FakeStream(), []
        intake = _Intake(stream, 3, batches.append)
        task = asyncio.ensure_future(intake.run())
        try:
            await scenario(stream, intake, batches)
        finally:
            task.cancel()
        return stream

    return asyncio.run(main())


def test_a_batch_is_what_has_arrived_up_to_the_maximum_and_acks_are_left_to_the_handler():
    async def scenario(stream, intake, batches):
        for e in range(7):
            stream.queue.put_nowait(e)
        await asyncio.sleep(0.01)
        assert batches == [[0, 1, 2], [3, 4, 5], [6]]
        stream.queue.put_nowait(7)
        await asyncio.sleep(0.01)
        assert batches[-1] == [7]

    assert _run(scenario).enable_acks is False


def test_a_batch_still_filling_when_faust_empties_the_queues_is_handled_at_once():
    async def scenario(stream, intake, batches):
        stream.queue.put_nowait("a")
        stream.queue.put_nowait("b")
        while intake.held != ["a"]:
            await asyncio.sleep(0)
        # "a" taken, "b" still queued: a rebalance empties the queue before "b" is taken
        stream.queue.get_nowait()
        intake.flush()
        assert batches == [["a"]] and intake.held == []
        stream.queue.put_nowait("c")  # after the rebalance: a batch of its own
        await asyncio.sleep(0.01)
        assert batches[-1] == ["c"]

    _run(scenario)


def test_while_flow_is_suspended_nothing_is_held_back():
    async def scenario(stream, intake, batches):
        stream.active = False
        for e in range(3):
            stream.queue.put_nowait(e)
        await asyncio.sleep(0.01)
        assert batches == [[0], [1], [2]]

    _run(scenario)
