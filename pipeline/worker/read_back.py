"""The worker's side of reading a first answer back (earlier_answers.py reads it from the broker).

Two uses. A copy the gateway dispatched again that this worker has no memory of reads the first
answer back before the model runs (``Processor._call``). And a record about to be answered
EXPIRED or CANCELLED that may have been answered elsewhere (``may_be_answered``) is answered so
only once no first answer is found: otherwise the id would get a second, different status. That
second use runs as a task, like a backend call, so its offset stays uncommitted until it ends,
and it is tried again while the broker cannot be read. A rebalance can leave many records
expiring at once: those waiting on the same reply partition are read back together, one pass
for all of them, one partition's pass at a time per partition.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from pipeline.models import REDELIVERED, Request, now_ms
from pipeline.worker.context import WorkerContext
from pipeline.worker.earlier_answers import UNREADABLE, may_be_answered
from pipeline.worker.state import out_of_doubt

log = logging.getLogger(__name__)

#: A sure read-back the broker could not answer is asked again this often, this many times; then
#: the record is answered as it is.
SURE_RETRY_S = 5.0
SURE_TRIES = 6


class ReadBack:
    def __init__(self, ctx: WorkerContext, tasks: dict):
        """``tasks``: the processor's running calls, (tp, offset) → task, which the look-ups
        before an EXPIRED or CANCELLED answer join (handed back and stopped with them)."""
        self.ctx = ctx
        self.tasks = tasks
        self.exactly_once = ctx.checkpoint.exactly_once
        #: At-least-once: when each partition was assigned here (ms). Records written before it
        #: may have been answered by its previous owner (earlier_answers.may_be_answered).
        self.assigned_at: dict[tuple[str, int], int] = {}
        #: Per reply partition, the ids whose first answers are to be read back there: id →
        #: (its earliest admission, the futures waiting for its answer).
        self._wanted: dict[tuple[str, int], dict[str, tuple[int, list]]] = {}
        self._readers: dict[tuple[str, int], asyncio.Task] = {}

    def assigned(self, partitions) -> None:
        """``partitions`` (``(topic, partition)``) are this worker's from now on."""
        if self.exactly_once:
            return  # an answer is visible only with its offset committed: nothing to look up
        now = now_ms()
        for tp in partitions:
            self.assigned_at[tp] = now

    def forget(self, partitions=None) -> None:
        """``partitions`` are this worker's no more (None: none is, a new session starts)."""
        if partitions is None:
            self.assigned_at.clear()
            for reader in self._readers.values():
                reader.cancel()
            self._readers.clear()
            self._wanted.clear()
            return
        for tp in partitions:
            self.assigned_at.pop(tp, None)

    def may_be_answered(self, msg, tp, request: Request) -> bool:
        """Whether the record may have been answered by another worker (or this one before a
        restart), whose first answer can be read back."""
        if not self.ctx.earlier.enabled or request.admitted_at is None:
            return False
        assigned_at = self.assigned_at.get(tp)
        headers = msg.headers()
        if assigned_at is None and not headers:
            return False
        return may_be_answered(headers, msg.timestamp() if assigned_at is not None else None, assigned_at)

    async def answered_before(self, tp, offset: int, request: Request, why: bytes | None,
                              surely: bool = False) -> bool:
        """Whether another worker answered ``request`` (a copy dispatched again, or a record its
        partition's previous owner took) already: if so, that answer is given again (exactly-once,
        not for a copy the gateway redelivered), and remembered for later copies. ``surely``: a
        read the broker could not answer is tried again (see earlier_answers.py)."""
        ctx = self.ctx
        topic, partition = ctx.responder.targets.of(request)
        earlier = ctx.earlier
        partition = earlier.place(topic, partition, request.tenant_id.encode())
        if partition is None:
            return False
        if surely:
            first = await self._first_answer((topic, partition), request)
        else:
            first = await asyncio.to_thread(earlier.find, topic, partition, request.request_id, request.admitted_at)
        if first is None:
            return False
        value, key = first
        log.info("request %s, dispatched again or taken over, was answered by another worker: that answer again",
                 request.request_id)
        ctx.recent.answered(request.request_id, (tp, offset), value, key)
        ctx.responder.duplicate(tp, offset, request, first, again=not (self.exactly_once and why == REDELIVERED))
        return True

    async def _first_answer(self, where: tuple[str, int], request: Request):
        """The first answer to ``request`` in reply partition ``where``, or None: read back with
        the others waiting there (see :meth:`_read`)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        wanted = self._wanted.setdefault(where, {})
        since, futures = wanted.get(request.request_id, (request.admitted_at, []))
        futures.append(future)
        wanted[request.request_id] = (min(since, request.admitted_at), futures)
        if where not in self._readers:
            self._readers[where] = loop.create_task(self._read(where))
        return await future

    async def _read(self, where: tuple[str, int]) -> None:
        """Read back the first answers wanted in ``where``, all those waiting in one pass, until
        none waits; a pass the broker could not answer is tried again (``SURE_TRIES``)."""
        topic, partition = where
        tries = 0
        batch: dict = {}
        try:
            while self._wanted.get(where):
                batch = self._wanted.pop(where)
                wanted = {rid: since for rid, (since, futures) in batch.items()
                          if any(not f.done() for f in futures)}  # handed back meanwhile: nobody waits
                if not wanted:
                    continue
                found = await asyncio.to_thread(self.ctx.earlier.find_many, topic, partition, wanted)
                if found is UNREADABLE:
                    tries += 1
                    if tries < SURE_TRIES:
                        self._merge(where, batch)
                        await asyncio.sleep(SURE_RETRY_S)
                        continue
                    log.warning("%s[%d] could not be read back %d times; answering the %d records waiting for "
                                "their first answers there as they are", topic, partition, tries, len(wanted))
                    found = {}
                tries = 0
                _resolve(batch, found)
        except Exception:  # noqa: BLE001 (a bug in the read-back must not leave records unanswered)
            log.exception("reading back first answers from %s[%d] failed; answering the records as they are",
                          topic, partition)
            _resolve(self._wanted.pop(where, {}), {})
            _resolve(batch, {})
        finally:
            if self._readers.get(where) is asyncio.current_task():
                del self._readers[where]

    def _merge(self, where: tuple[str, int], batch: dict) -> None:
        wanted = self._wanted.setdefault(where, {})
        for rid, (since, futures) in batch.items():
            if rid in wanted:
                later_since, later = wanted[rid]
                wanted[rid] = (min(since, later_since), futures + later)
            else:
                wanted[rid] = (since, futures)

    def settle(self, answer: functools.partial, why: bytes | None) -> None:
        """Give ``answer`` (EXPIRED or CANCELLED: the responder's call with its message's place and
        request) unless a first answer is found: in a task whose offset stays uncommitted until it
        ends (handed back, the next owner looks it up again). ``why``: why the gateway dispatched
        the id again, None if it did not."""
        tp, offset, request = answer.args[:3]
        key = (tp, offset)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven without an event loop (a tool, a benchmark): no broker to read
            answer()
            return
        self.tasks[key] = loop.create_task(self._settle_after_look(key, request, answer, why))

    async def _settle_after_look(self, key, request: Request, answer, why) -> None:
        tp, offset = key
        try:
            try:
                found = await self.answered_before(tp, offset, request, why, surely=True)
            except Exception:  # noqa: BLE001 (a bug in the read-back must not leave the record unanswered)
                log.exception("reading back the first answer to %s failed; answering it as it is", request.request_id)
                found = False
            if not found:
                session = self.ctx.session
                await out_of_doubt(session, self.ctx.cfg.session_timeout_ms / 1000.0)  # see Processor._call
                answer()
        finally:
            if self.tasks.get(key) is asyncio.current_task():
                del self.tasks[key]
            self.ctx.flow.slot_freed()


def _resolve(batch: dict, found: dict) -> None:
    """Each future of ``batch`` (id → (since, futures)) gets its id's answer in ``found``, or None."""
    for rid, (_, futures) in batch.items():
        answer = found.get(rid)
        for future in futures:
            if not future.done():
                future.set_result(answer)
