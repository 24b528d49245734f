"""When a request is done: its outputs delivered, and its decision and state written.

Agents decide requests one by one and hand their outputs here. The checkpoint task, in a loop
(a *round*), writes what was decided since the last round to the Faust tables, the new ids seen
(the decisions, one record per request partition), waits until Faust's producer has delivered
them, and only then sends the round's outputs (:class:`~pipeline.gateway.outputs.Outputs`). The
tenants' changed records are written every ``state_every_s``. A request is acknowledged (and so
committed by Faust) once its outputs are delivered and a state write after its decision is
durable. A round's cost is a few records whatever the number of tenants; while one round waits
for the broker, the next requests are decided.

An answer never leaves before its decision is durable: a gateway killed at any moment either
left no trace of a request (it is decided again, as if for the first time) or recorded what it
decided (it goes out again unchanged). Deciding again a request whose answer had gone out could
answer it twice, differently: the queue's verdicts (queue_full, load, a deadline the queue
cannot meet) move on, and the requests of five band topics are not read back in the order they
were first decided. The wait costs each answer one write to the broker (the round it is
decided in), which the rounds share.

Exactly-once (``transactions`` given, :mod:`pipeline.gateway.transactions`), a round's outputs
go out in transactions with the offsets of their requests, so the offsets commit with the
outputs instead of after the next state write: the tenants' records are written in every round
(before the transactions), and rounds never overlap (a round that ended later could commit an
offset behind an earlier one's).
"""

from __future__ import annotations

import asyncio
import logging
import time

from pipeline.gateway.outputs import Done, Output, Outputs
from pipeline.gateway.seen import SeenDecisions
from pipeline.gateway.transactions import Transactions
from pipeline.gateway.tenant_states import TenantStates
from pipeline.models import now_ms

log = logging.getLogger(__name__)


class DecisionCheckpoint:
    """An output leaves only after the decision behind it is durable; a request is acknowledged
    once its outputs are delivered and its tenant's state is written."""

    def __init__(self, producer, tenants: TenantStates, seen: SeenDecisions, outputs: Outputs | None, *,
                 state_every_s: float = 1.0, every_s: float = 0.0, transactions: Transactions | None = None):
        self.producer = producer  # Faust's (the changelogs')
        self.tenants = tenants
        self.seen = seen
        self.outputs = outputs
        self.transactions = transactions
        # A transaction commits its requests' offsets: their state must be written before it.
        self.state_every_s = 0.0 if transactions is not None else state_every_s
        self._one_at_a_time = asyncio.Lock()
        self.every_s = every_s
        self._dones: list[Done] = []  # decided since the last round
        # Their outputs, each request's with its countdown, sent once the round has written the decisions.
        self._outputs: list[tuple[Done, list[Output]]] = []
        self._unwritten: list[Done] = []  # sent, their tenant state not written yet
        self._state_at = time.monotonic()
        self._wake = asyncio.Event()
        self.rounds = 0

    def after_write(self, event, outputs: list[Output]) -> None:
        """Send ``outputs`` once ``event``'s decision is written, and acknowledge it once they are
        delivered and its state is written."""
        done = Done(event, len(outputs))
        if outputs:
            self._outputs.append((done, outputs))
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
            if self.every_s:
                # What is decided meanwhile goes into the same records: fewer of them.
                await asyncio.sleep(self.every_s)
            await self.round()

    async def round(self, *, final: bool = False) -> None:
        if self.transactions is None:
            await self._round(final)
            return
        async with self._one_at_a_time:
            await self._round(final)

    async def _round(self, final: bool) -> None:
        self._wake.clear()
        dones, self._dones = self._dones, []
        outputs, self._outputs = self._outputs, []
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
        superseded: set[int] = set()
        if self.transactions is not None:
            result = await self.transactions.commit(dones, outputs)
            if result is None:
                return  # the gateway is stopping: nothing of this round is acknowledged
            superseded = result  # partitions that moved while the round ran: their owner redoes them
            for done, outs in outputs:
                if _partition(done) not in superseded:
                    for _ in outs:
                        done.one()
        else:
            send = self.outputs.send
            for done, outs in outputs:
                for output in outs:
                    send(output, done)
        for done in written:
            if not superseded or _partition(done) not in superseded:
                done.one()
        self.rounds += 1


def _partition(done: Done) -> int | None:
    msg = getattr(done.event, "message", None)
    return None if msg is None else msg.partition
