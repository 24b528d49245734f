"""Flow control: how much the consumer fetches while the worker is busy.

The loop never stops polling (polls serve rebalances and keep ``max.poll.interval.ms``
satisfied), so what holds work back is pausing. The worker reads ahead of its slots, so that
fair queuing sees every tenant who waits (scheduler.py); a partition is paused only if its
queue is still at the cap (``worker.lookahead_requests``, or ``worker.lookahead_bytes`` in
all) after the free slots are filled: librdkafka drops a paused partition's
prefetched messages and fetches them again, so pausing on the way in would refetch what a
fast backend clears in the same turn. Pausing a partition rather than its whole band keeps a
flooding tenant's partition from filling the band's queue. On drain the whole assignment is
paused.

librdkafka keeps a pause flag per partition across assignments, so after every rebalance the
flags are made to match what this worker wants (:meth:`Flow.reapply`).
"""

from __future__ import annotations

import asyncio

from confluent_kafka import TopicPartition

from pipeline.config import WorkerSettings
from pipeline.worker.scheduler import Scheduler
from pipeline.worker.state import Session


class Flow:
    def __init__(self, cfg: WorkerSettings, session: Session, scheduler: Scheduler):
        self.cfg = cfg  # max_inflight is read at every turn
        self.session = session
        self.scheduler = scheduler
        self.paused = False  # the whole assignment (drain)
        self.paused_parts: set[tuple[str, int]] = set()
        self.assignment_changed = False
        self._slot_free = asyncio.Event()

    def reset(self) -> None:
        self.paused = False
        self.paused_parts.clear()

    # -- max in flight ---------------------------------------------------------------------

    def full(self, in_flight: int) -> bool:
        return in_flight >= self.cfg.max_inflight

    def slot_freed(self) -> None:
        self._slot_free.set()

    async def wait_for_slot(self, idle_s: float) -> None:
        """Every slot is busy: wait for one to free, at most ``idle_s`` (a higher band's request
        that arrives meanwhile is seen then, and preempts once it has waited
        ``worker.preempt_after_ms``)."""
        self._slot_free.clear()
        try:
            await asyncio.wait_for(self._slot_free.wait(), idle_s)
        except asyncio.TimeoutError:
            pass

    # -- pausing deep partitions -------------------------------------------------------------

    def turn(self) -> None:
        """After a turn's dispatch: pause what is still deep, resume what drained."""
        if self.scheduler.deep:
            self.pause_deep()
        self.resume_drained()

    def pause_deep(self) -> None:
        """Pause the partitions whose queue is still at its cap once the free slots are filled."""
        scheduler = self.scheduler
        for tp in scheduler.deep:
            if scheduler.over(tp):
                self.set_paused(tp, True)
        scheduler.deep.clear()

    def resume_drained(self) -> None:
        """Resume the paused partitions whose queue is down to half its cap (and the bytes of all
        to half of theirs)."""
        if not self.paused_parts or self.paused:
            return
        drained = self.scheduler.drained
        for tp in [tp for tp in self.paused_parts if drained(tp)]:
            self.set_paused(tp, False)

    def set_paused(self, tp: tuple[str, int], paused: bool) -> None:
        if paused == (tp in self.paused_parts):
            return
        if paused:
            self.paused_parts.add(tp)
        else:
            self.paused_parts.discard(tp)
        # Only an assigned partition has a flag to set; one assigned later gets it from reapply().
        consumer = self.session.consumer
        if self.paused or not any(a.topic == tp[0] and a.partition == tp[1] for a in consumer.assignment()):
            return
        (consumer.pause if paused else consumer.resume)([TopicPartition(*tp)])

    def forget(self, partitions: set) -> None:
        """``partitions`` are no longer ours: whatever they had queued is gone."""
        self.paused_parts -= partitions

    # -- rebalances and drain --------------------------------------------------------------

    def reapply(self) -> None:
        """Make librdkafka's pause flags match ours for whatever is assigned now.

        Both directions matter: a newly assigned partition starts unpaused, but one that comes
        back after being revoked or lost keeps the flag it had, and a partition resumed while
        it was away must not stay paused forever.
        """
        consumer = self.session.consumer
        assignment = consumer.assignment()
        if not assignment:
            return
        if self.paused:
            consumer.pause(assignment)
            return
        paused, running = [], []
        for tp in assignment:
            (paused if (tp.topic, tp.partition) in self.paused_parts else running).append(tp)
        if paused:
            consumer.pause(paused)
        if running:
            consumer.resume(running)

    def reapply_if_reassigned(self) -> None:
        if self.assignment_changed:
            self.assignment_changed = False
            self.reapply()

    def pause_all(self) -> None:
        """Stop fetching altogether (drain): the consumer keeps polling, for group membership only."""
        assignment = self.session.consumer.assignment()
        if assignment:
            self.session.consumer.pause(assignment)
        self.paused = True
