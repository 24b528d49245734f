"""Two adjustments to faust-streaming 0.15.3, applied once before the gateway app starts.

1. **Seek before resume after table recovery.** ``Recovery.on_recovery_completed`` resumes the
   source partitions and only then seeks them to their committed offsets, while the fetcher
   already runs: events fetched in between are delivered, then delivered again after the seek,
   and with faust's commit bookkeeping an event can even be committed past unprocessed (found
   with a reproduction against a real broker; faust#216 fixed only the table-less path). The
   wrapper defers the resume until the seek is done.
2. **A short fetch wait.** faust hard-codes aiokafka's ``fetch_max_wait_ms`` to 1500 ms; after
   every seek, resume or rebalance the first fetch then idles that long. The transport below
   sets it from the gateway settings (``kafka+llmq://`` URLs select it).
"""

from __future__ import annotations

import functools

from faust.tables.recovery import Recovery
from faust.transport import drivers
from faust.transport.drivers import aiokafka as faust_aiokafka

FETCH_MAX_WAIT_MS = 5  # set by the gateway from its settings before the app starts
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


class ShortFetchTransport(faust_aiokafka.Transport):
    Consumer = _ShortFetchConsumer
