"""Write-ahead for the gateway: state first, then outputs, then the request's acknowledgement.

Agents decide requests one by one and hand their outputs here. The checkpoint task then, in a
loop, takes everything handed in so far and

1. writes the changed tenant records and the new ids seen to their Faust tables, and waits
   until Faust's producer has delivered those changelog records;
2. sends the outputs (:class:`~pipeline.gateway.outputs.Outputs`);
3. acknowledges each request once its outputs are delivered.

While one round waits for the broker the next requests are already being decided, so under load
a round carries many requests and the changelogs get one record per changed tenant per round.
"""

from __future__ import annotations

import asyncio
import logging

from pipeline.gateway.outputs import Done, Outputs
from pipeline.gateway.seen import RecentIds
from pipeline.gateway.tenants import TenantStates
from pipeline.models import now_ms

log = logging.getLogger(__name__)


class Checkpoint:
    def __init__(self, producer, tenants: TenantStates, seen: RecentIds, outputs: Outputs, *, every_s: float = 0.0):
        self.producer = producer  # Faust's (the changelogs')
        self.tenants = tenants
        self.seen = seen
        self.outputs = outputs
        self.every_s = every_s
        self._pending: list = []  # (output, Done)
        self._dones: list[Done] = []
        self._wake = asyncio.Event()
        self.rounds = 0

    def after_write(self, event, outputs: list) -> None:
        """Send ``outputs`` (``(topic, value, key, headers)``), then acknowledge ``event``, once the
        state its decision changed is written."""
        done = Done(event, len(outputs))
        self._pending.extend((output, done) for output in outputs)
        self._dones.append(done)
        self._wake.set()

    @property
    def waiting(self) -> int:
        return len(self._dones)

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            if self.every_s:
                await asyncio.sleep(self.every_s)
            await self.round()

    async def round(self) -> None:
        self._wake.clear()
        pending, self._pending = self._pending, []
        dones, self._dones = self._dones, []
        if not dones:
            return
        now = now_ms()
        self.tenants.flush(now)
        self.seen.flush(now)
        await self.producer.flush()
        send = self.outputs.send
        for (topic, value, key, headers), done in pending:
            send(topic, value, key, done, headers)
        for done in dones:
            done.one()
        self.rounds += 1
