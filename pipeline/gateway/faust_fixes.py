"""Three adjustments to faust-streaming 0.15.3, applied once before the gateway app starts.

1. **Seek before resume after table recovery.** ``Recovery.on_recovery_completed`` resumes the
   source partitions and only then seeks them to their committed offsets, while the fetcher
   already runs: events fetched in between are delivered, then delivered again after the seek,
   and with faust's commit bookkeeping an event can even be committed past unprocessed (found
   with a reproduction against a real broker; faust#216 fixed only the table-less path). The
   wrapper defers the resume until the seek is done.
2. **A shorter fetch wait.** faust hard-codes aiokafka's ``fetch_max_wait_ms`` to 1500 ms; after
   every seek, resume or rebalance the first fetch then idles that long (aiokafka sends no new
   fetch to a broker while one is in flight). The transport below sets it from the gateway
   settings (``kafka+llmq://`` URLs select it); not much shorter than 100 ms, as every empty
   fetch costs both the gateway and the broker CPU.
3. **Delivering a fetched message inline.** faust's fetcher wraps each message's delivery to
   the agents in ``wait_first`` (four tasks per message); the consumer below runs it inline
   when it does not need to wait, which took the gateway from ~1,000 to ~4,500 admitted/s here
   and lets agents see a whole fetch at once instead of one message per loop turn.
"""

from __future__ import annotations

import asyncio
import functools

from faust.tables.recovery import Recovery
from faust.transport import drivers
from faust.transport.drivers import aiokafka as faust_aiokafka

_EVENT_WAIT = asyncio.Event.wait.__code__  # the consumer's suspend_flow is an asyncio.Event
FETCH_MAX_WAIT_MS = 100  # set by the gateway from its settings before the app starts
_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    _applied = True
    original = Recovery.on_recovery_completed

    @functools.wraps(original)
    async def on_recovery_completed(self, generation_id: int = 0) -> None:
        consumer = self.app.consumer
        deferred: list = []
        resume, seek = consumer.resume_partitions, consumer.perform_seek

        def resume_after_seek(partitions):
            deferred.append(partitions)

        async def seek_then_resume():
            await seek()
            while deferred:
                resume(deferred.pop(0))

        consumer.resume_partitions, consumer.perform_seek = resume_after_seek, seek_then_resume
        try:
            await original(self, generation_id)
        finally:
            del consumer.resume_partitions, consumer.perform_seek  # back to the class's methods
            # No seek happened (nothing assigned, or a new rebalance began): resume as faust would.
            while deferred:
                resume(deferred.pop(0))

    Recovery.on_recovery_completed = on_recovery_completed
    drivers.TRANSPORTS.aliases["kafka+llmq"] = f"{__name__}:ShortFetchTransport"


class _ShortFetchThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_consumer(self, loop):
        consumer = super()._create_consumer(loop)
        # Read by aiokafka only when the consumer starts, which is after this.
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        return consumer


class _ShortFetchConsumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self):
        return _ShortFetchThread(self, loop=self.loop, beacon=self.beacon)

    async def wait_first(self, *coros, timeout=None):
        """faust hands every fetched message to its streams as ``wait_first(deliver(message),
        suspend_flow.wait())``: four tasks and an ``asyncio.wait`` per message, and a trip
        through the event loop that lets an agent wake for each single message. Delivery
        almost never has to wait (it puts the event in the agent's queue), so it is first run
        inline; only if it does wait (a full queue) does it continue as faust would run it."""
        if (len(coros) == 2 and timeout is None and getattr(coros[1], "cr_code", None) is _EVENT_WAIT
                and not self.suspend_flow.is_set()):
            deliver, suspended = coros
            try:
                pending = deliver.send(None)
            except StopIteration:
                suspended.close()
                return None
            coros = (_Continue(deliver, pending).run(), suspended)
        return await super().wait_first(*coros, timeout=timeout)


class _Continue:
    """Awaitable that resumes a coroutine which has already run up to its first suspension
    (``first``: what it yielded there, handed on to the task that now drives it)."""

    def __init__(self, coro, first):
        self.coro, self.first = coro, first

    async def run(self):
        return await self

    def __await__(self):
        coro, yielded = self.coro, self.first
        while True:
            try:
                sent = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # thrown into the task (e.g. cancellation): pass it on
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


class ShortFetchTransport(faust_aiokafka.Transport):
    Consumer = _ShortFetchConsumer
