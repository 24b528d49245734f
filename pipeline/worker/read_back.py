"""The worker's side of reading a first answer back (earlier_answers.py reads it from the broker).

Two uses. A copy the gateway dispatched again that this worker has no memory of reads the first
answer back before the model runs (``Processor._call``). And a record about to be answered
EXPIRED or CANCELLED that may have been answered elsewhere (``may_be_answered``) is answered so
only once no first answer is found: otherwise the id would get a second, different status. That
second use runs as a task, like a backend call, so its offset stays uncommitted until it ends,
and it is tried again while the broker cannot be read.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from pipeline.models import REDELIVERED, Request, now_ms
from pipeline.worker.context import WorkerContext
from pipeline.worker.earlier_answers import UNREADABLE, may_be_answered

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
        find = functools.partial(earlier.find, topic, partition, request.request_id, request.admitted_at)
        first = await asyncio.to_thread(find, surely) if surely else await asyncio.to_thread(find)
        tries = 1
        while first is UNREADABLE:
            if tries >= SURE_TRIES:
                log.warning("request %s: its first answer, if any, could not be read back %d times; answering it "
                            "as it is", request.request_id, tries)
                return False
            await asyncio.sleep(SURE_RETRY_S)
            first = await asyncio.to_thread(find, surely)
            tries += 1
        if first is None:
            return False
        value, key = first
        log.info("request %s, dispatched again or taken over, was answered by another worker: that answer again",
                 request.request_id)
        ctx.recent.answered(request.request_id, (tp, offset), value, key)
        ctx.responder.duplicate(tp, offset, request, first, again=not (self.exactly_once and why == REDELIVERED))
        return True

    def settle(self, answer: functools.partial, why: bytes | None) -> None:
        """Give ``answer`` (EXPIRED or CANCELLED: the responder's call with its message's place and
        request) unless a first answer is found: in a task whose offset stays uncommitted until it
        ends (handed back, the next owner looks it up again). ``why``: why the gateway dispatched
        the id again, None if it did not."""
        tp, offset, request = answer.args[:3]
        key = (tp, offset)
        self.tasks[key] = asyncio.get_running_loop().create_task(self._settle_after_look(key, request, answer, why))

    async def _settle_after_look(self, key, request: Request, answer, why) -> None:
        tp, offset = key
        try:
            try:
                found = await self.answered_before(tp, offset, request, why, surely=True)
            except Exception:  # noqa: BLE001 (a bug in the read-back must not leave the record unanswered)
                log.exception("reading back the first answer to %s failed; answering it as it is", request.request_id)
                found = False
            if not found:
                answer()
        finally:
            if self.tasks.get(key) is asyncio.current_task():
                del self.tasks[key]
            self.ctx.flow.slot_freed()
