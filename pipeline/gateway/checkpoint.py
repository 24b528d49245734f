"""Write-ahead for the gateway: decisions first, then outputs; state, then acknowledgements.

Agents decide requests one by one and hand their outputs here. The checkpoint task then, in a
loop (a *round*), takes everything handed in so far and

1. writes the new ids seen (the decisions: one record per request partition) to their Faust
   table and waits until Faust's producer has delivered them;
2. sends the outputs (:class:`~pipeline.gateway.outputs.Outputs`).

The tenants' records are written every ``state_every_s`` (each changed record once) in the same
way, before that round's outputs; a request is acknowledged once its outputs are delivered and
a state write after its decision is durable. A round's cost is a few records whatever the number
of tenants, so the latency of an answer does not grow with them; while one round waits for the
broker, the next requests are already being decided.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pipeline.gateway.outputs import Done, Outputs
from pipeline.gateway.seen import RecentIds
from pipeline.gateway.tenants import TenantStates
from pipeline.models import now_ms

log = logging.getLogger(__name__)


class Checkpoint:
    def __init__(self, producer, tenants: TenantStates, seen: RecentIds, outputs: Outputs, *,
                 state_every_s: float = 0.1):
        self.producer = producer  # Faust's (the changelogs')
        self.tenants = tenants
        self.seen = seen
        self.outputs = outputs
        self.state_every_s = state_every_s
        self._pending: list = []  # (output, Done) not sent yet
        self._dones: list[Done] = []  # decided since the last round
        self._unwritten: list[Done] = []  # sent, their tenant state not written yet
        self._state_at = time.monotonic()
        self._wake = asyncio.Event()
        self.rounds = 0

    def after_write(self, event, outputs: list) -> None:
        """Send ``outputs`` (``(topic, value, key, headers[, partition])``) once ``event``'s decision is written,
        and acknowledge ``event`` once they are delivered and its state is written."""
        done = Done(event, len(outputs))
        self._pending.extend((output, done) for output in outputs)
        self._dones.append(done)
        self._wake.set()

    @property
    def waiting(self) -> int:
        return len(self._dones) + len(self._unwritten)

    async def run(self) -> None:
        while True:
            if self._unwritten and not self._dones:
                # Only state to write: wake for it when it is due, or for new work before that.
                due = self._state_at + self.state_every_s - time.monotonic()
                try:
                    await asyncio.wait_for(self._wake.wait(), max(0.0, due))
                except asyncio.TimeoutError:
                    pass
            else:
                await self._wake.wait()
            await self.round()

    async def round(self, *, final: bool = False) -> None:
        self._wake.clear()
        pending, self._pending = self._pending, []
        dones, self._dones = self._dones, []
        if not dones and not self._unwritten:
            return
        now = now_ms()
        self.seen.flush(now)
        self._unwritten.extend(dones)
        written: list[Done] = []
        if final or time.monotonic() - self._state_at >= self.state_every_s:
            self.tenants.flush(now)
            self._state_at = time.monotonic()
            written, self._unwritten = self._unwritten, []
        await self.producer.flush()
        send = self.outputs.send
        for output, done in pending:
            send(output[0], output[1], output[2], done, output[3], *output[4:])
        for done in written:
            done.one()
        self.rounds += 1
