"""Which taken request starts next, and which running call gives its slot away.

Taken requests wait in one :class:`~pipeline.policy.fair_queue.FairQueue` per band: weighted
fair queuing between tenants by tokens (virtual token counters), earliest deadline first inside
a tenant, whatever partition a tenant's key hashed to. The band to serve next is the
:class:`~pipeline.policy.bands.BandScheduler`'s: strict priority, except for a lower band below
its minimum share. The worker reads ahead (``worker.lookahead_requests`` per partition,
``worker.lookahead_bytes`` in all) so that the choice is made over everyone who waits.

While every backend slot is busy, a request waiting in a higher band may take the slot of a
running call of a preemptible band (``worker.preempt_bands``); failing that, a request whose
tenant runs no call in its band may take the slot of a tenant running two or more there
(``worker.fair_preemption``). The call cancelled goes back to its queue and runs again later;
its offset stays taken and unfinished meanwhile, so nothing is committed past it.
"""

from __future__ import annotations

import math
from typing import Callable

from pipeline.config import Settings
from pipeline.models import BANDS, LOWEST_RANK, NOT_BEFORE_HEADER, Priority, Request, now_ms
from pipeline.observability.metrics import WorkerMetrics
from pipeline.policy.bands import BandScheduler
from pipeline.policy.fair_queue import FairQueue, Waiting, request_cost
from pipeline.policy.tokens import estimate_tokens
from pipeline.worker.state import WorkerStats

#: What a queued request takes in memory beyond its record's bytes (its decoded form, the
#: message object, the queue's entry): a rough figure, for worker.lookahead_bytes.
ENTRY_OVERHEAD_BYTES = 1024


def topic_bands(settings: Settings) -> dict[str, Priority]:
    """Topic → band, for the request topics and the gateway's dispatch topics."""
    topics = settings.topics
    bands = {topics.request_topic(p): p for p in BANDS}
    bands.update({topics.dispatch_topic(p): p for p in BANDS})
    return bands


def not_before_of(msg) -> int:
    """The time before which the gateway asked that this request not start (0: none)."""
    headers = msg.headers()
    if headers:
        for name, value in headers:
            if name == NOT_BEFORE_HEADER and value:
                try:
                    return int(value)
                except ValueError:
                    return 0
    return 0


class Scheduler:
    def __init__(self, settings: Settings, topics: list[str], stats: WorkerStats, metrics: WorkerMetrics,
                 weight_of: Callable[[str], float] | None = None):
        cfg = settings.worker
        self.cfg = cfg
        self.stats = stats
        self.metrics = metrics
        self.rank = {topic: band.rank for topic, band in topic_bands(settings).items()}
        self.bands = BandScheduler([cfg.band_min_share.get(p.value, 0.0) for p in BANDS])
        configured = cfg.tenant_weights
        self.weight_of = (lambda tenant: configured.get(tenant) or (weight_of(tenant) if weight_of else 1.0))
        self.queues = [FairQueue(self.weight_of) for _ in BANDS]
        # Off: every request under one name, so a band is one queue in deadline order.
        self._fair_queuing = cfg.fair_queuing
        #: Per partition, in requests: past it (or past lookahead_bytes in all) a partition is
        #: paused (flow.py), so librdkafka's shared fetch queue never holds higher-band work behind it.
        self.cap = cfg.lookahead_requests
        self.cap_bytes = cfg.lookahead_bytes
        #: Partitions whose queue reached the cap this turn (flow.py pauses those still full
        #: once the free slots are filled).
        self.deep: set[tuple[str, int]] = set()
        # Preemption only of bands below another band this worker consumes: a pool of
        # BACKGROUND alone never preempts (nor polls faster for it).
        consumed = {self.rank[t] for t in topics if t in self.rank}
        self.preemptible = frozenset(r for r in (Priority[b].rank for b in cfg.preempt_bands)
                                     if r in consumed and any(c < r for c in consumed))
        # Running calls that may give their slot to a waiting request of a higher band:
        # key → (band rank, start order, entry, task, request id).
        self.victims: dict[tuple, tuple] = {}
        self.preempt_counts: dict[tuple, int] = {}  # key → times preempted so far
        self._starts = 0
        # Fairness inside a band: running calls by (band rank, tenant), each key → (start
        # order, entry, task, request id); how many of those run two or more.
        self._fair = cfg.fair_preemption
        self.by_tenant: dict[tuple, dict[tuple, tuple]] = {}
        self.tenant_of_call: dict[tuple, tuple] = {}  # key → (band rank, tenant)
        self.crowded = 0
        self._owed: set[int] = set()  # id() of the entries of the chunk in hand started on a minimum share

    def rank_of(self, topic: str) -> int:
        return self.rank.get(topic, LOWEST_RANK)

    def reset(self) -> None:
        """Forget every queued message and running call (a session starting over)."""
        self.queues = [FairQueue(self.weight_of) for _ in BANDS]
        self.deep.clear()
        self.victims.clear()
        self.preempt_counts.clear()
        self.by_tenant.clear()
        self.tenant_of_call.clear()
        self.crowded = 0

    # -- the queues ------------------------------------------------------------------------

    @property
    def queued_bytes(self) -> int:
        return sum(q.bytes for q in self.queues)

    def add(self, tp: tuple[str, int], msg, request: Request) -> None:
        """Queue a taken, decoded message in its band."""
        queue = self.queues[self.rank.get(tp[0], LOWEST_RANK)]
        value = msg.value()
        deadline = request.created_at + request.timeout_ms
        not_before = not_before_of(msg)
        if not_before > deadline:
            not_before = deadline  # held no longer than its deadline (then answered EXPIRED)
        entry = Waiting((msg, request), request.tenant_id if self._fair_queuing else "", tp, deadline,
                        request_cost(estimate_tokens(request.prompt), request.max_tokens), not_before,
                        (len(value) if value else 0) + ENTRY_OVERHEAD_BYTES)
        now = entry.since_ms = now_ms()
        # (Every band's bytes are summed only once this band holds a fifth of the bound: the sum
        # reaches the bound only if some band does.)
        if queue.push(entry, now) >= self.cap or (
                queue.bytes * len(self.queues) >= self.cap_bytes and self.queued_bytes >= self.cap_bytes):
            self.deep.add(tp)

    def over(self, tp: tuple[str, int]) -> bool:
        """Whether ``tp`` holds its cap of requests, or every band together holds the bytes' cap."""
        return (self.queues[self.rank.get(tp[0], LOWEST_RANK)].depth(tp) >= self.cap
                or self.queued_bytes >= self.cap_bytes)

    def drained(self, tp: tuple[str, int]) -> bool:
        """Whether a paused ``tp`` may fetch again: down to half its cap, and half the bytes in all."""
        queue = self.queues[self.rank.get(tp[0], LOWEST_RANK)]
        return queue.depth(tp) <= self.cap // 2 and self.queued_bytes <= self.cap_bytes // 2

    def depth(self, tp: tuple[str, int]) -> int:
        return self.queues[self.rank.get(tp[0], LOWEST_RANK)].depth(tp)

    def take_back(self, tp: tuple[str, int]) -> Waiting | None:
        """The entry :meth:`add` just queued for ``tp``."""
        return self.queues[self.rank.get(tp[0], LOWEST_RANK)].remove_last()

    def next_chunk(self, room: int) -> list[Waiting]:
        """Up to ``room`` queued requests, in the order the band scheduler and the bands' fair
        queues pick them one by one, each charged to its tenant.

        Picking ahead changes nothing: nothing is taken while the chunk is processed, and
        processing touches neither the queues nor the band scheduler (what does not start is
        :meth:`put_back`, its charge given back). :meth:`chunk_done` once the chunk's calls
        are started.
        """
        queues, pick, record, owed = self.queues, self.bands.pick, self.bands.record, self._owed
        now = now_ms()
        chunk: list = []
        while len(chunk) < room:
            busy = [q.size > 0 and q.has_ready(now) for q in queues]
            band = pick(busy)
            if band is None:
                break
            if busy.count(True) == 1:
                # The only band with work: every pick would choose it.
                queue = queues[band]
                while len(chunk) < room:
                    entry = queue.pop(now)
                    if entry is None:
                        break
                    record(band)
                    chunk.append(entry)
                continue
            record(band)
            entry = queues[band].pop(now)
            if band != busy.index(True):
                # Started on its band's minimum share: preempting it would take back the
                # share the band scheduler has just counted as given.
                owed.add(id(entry))
            chunk.append(entry)
        return chunk

    def chunk_done(self) -> None:
        self._owed.clear()

    def put_back(self, entry: Waiting) -> None:
        """A picked request whose model's servers had no room after all: back in its place in
        its band's queue, its tenant's charge for it given back."""
        self.queues[self.rank.get(entry.partition[0], LOWEST_RANK)].put_back(entry)

    def settle(self, entry: Waiting, prompt_tokens: int, completion_tokens: int) -> float:
        """``entry``'s request was served with this usage: its tenant's counter is corrected from
        the estimate it was charged. Returns the real cost."""
        cost = request_cost(prompt_tokens, completion_tokens)
        self.queues[self.rank.get(entry.partition[0], LOWEST_RANK)].settle(entry.tenant, cost - entry.cost)
        entry.cost = cost
        return cost

    def next_ready_at(self) -> float | None:
        """When the earliest request shaped by the gateway may start (None: nothing waits for its time)."""
        times = [t for t in (q.next_ready_at() for q in self.queues) if t is not None]
        return min(times) if times else None

    def drop(self, partitions: set) -> None:
        """Forget what ``partitions`` queued and run: taken but uncommitted, their next owner runs it."""
        for queue in self.queues:
            queue.drop(partitions)
        self.deep -= partitions
        for table in (self.victims, self.preempt_counts):
            for key in [key for key in table if key[0] in partitions]:
                del table[key]
        for key in [key for key in self.tenant_of_call if key[0] in partitions]:
            self._forget_call(key)

    # -- running calls ---------------------------------------------------------------------

    def call_started(self, key: tuple, entry: Waiting, task, request_id: str) -> None:
        """A backend call for ``entry`` (``key``: (tp, offset)) runs as ``task``."""
        rank = self.rank.get(key[0][0], LOWEST_RANK)
        self._starts += 1
        if rank in self.preemptible and id(entry) not in self._owed and \
                self.preempt_counts.get(key, 0) < self.cfg.max_preemptions:
            self.victims[key] = (rank, self._starts, entry, task, request_id)
        if self._fair:
            self._track_call(key, rank, entry.tenant, (self._starts, entry, task, request_id))

    def call_ended(self, key: tuple, task) -> None:
        """``task``, the call of ``key``, ended (answered, failed or cancelled)."""
        victim = self.victims.get(key)
        if victim is not None and victim[3] is task:
            del self.victims[key]
        self._forget_call(key)
        self.preempt_counts.pop(key, None)

    def keep(self, key: tuple) -> None:
        """The call of ``key`` may no longer be preempted (a stream whose first tokens are out:
        run again, it would send them again)."""
        self.victims.pop(key, None)
        self._forget_call(key)

    @property
    def may_preempt(self) -> bool:
        return bool(self.victims or self.crowded)

    def preempt(self, accept=None):
        """Every slot is busy: pick one running call of a preemptible band lower than the band
        served next and put its request back in its place in its band's queue. Returns
        the call's ``(key, task, request id)`` for the caller to cancel, or None.

        The victim is the most recently started call of the lowest such band (the least work
        thrown away). Failing such a call, one of a tenant crowding the served band
        (:meth:`_crowding_call`), which waits behind the request it made way for.
        ``accept(key)``: whether the call of ``key`` holds a slot the waiting request can use
        (a model server of its model); None: every call does.
        """
        now = now_ms()
        band = self.bands.pick([q.size > 0 and q.has_ready(now) for q in self.queues])
        if band is None:
            return None
        head = self.queues[band].peek(now)
        if head is not None and now - head.since_ms < self.cfg.preempt_after_ms:
            return None  # a slot may yet free on its own: preempting throws work away
        victim = None
        for key, entry in self.victims.items():
            if entry[0] > band and (victim is None or entry[:2] > victim[1][:2]) and (accept is None or accept(key)):
                victim = (key, entry)
        behind = None
        if victim is None:
            victim = self._crowding_call(band, now, accept) if self.crowded else None
            if victim is None:
                return None
            self.stats.preempted_in_band += 1
            # Not served, so its tenant's charge goes back, but only down to the counter of the
            # tenant it made way for, which goes first.
            behind = self.queues[band].peek(now).tenant
        key, (rank, _, entry, task, request_id) = victim
        self.victims.pop(key, None)
        self._forget_call(key)
        self.preempt_counts[key] = self.preempt_counts.get(key, 0) + 1
        self.queues[rank].put_back(entry, behind=behind)
        self.stats.preempted += 1
        self.metrics.preemptions.labels(BANDS[rank].value).inc()
        return key, task, request_id

    def _crowding_call(self, band: int, now: float, accept=None):
        """When the request ``band`` serves next is of a tenant running no call in that band
        while another tenant runs two or more there: the latest-started of those calls that may
        still be preempted, as (key, (band, start order, message, task, request id)), else None.

        A call from the waiting request's own partition is never chosen: it would go back
        ahead of the request and be taken again in its place.
        """
        head = self.queues[band].peek(now)
        if head is None or (band, head.tenant) in self.by_tenant:
            return None
        partition = head.partition
        limit, counts = self.cfg.max_preemptions, self.preempt_counts
        # A tenant gives way only while it holds more slots than its weighted share of those the
        # band's calls hold (rounded up): a weight-2 tenant holding 2 of 2 slots beside a weight-1
        # one holds its share, and preempting it would undo the fair queue's choice.
        running = {tenant: calls for (rank, tenant), calls in self.by_tenant.items() if rank == band}
        weight = self.weight_of
        total_weight = weight(head.tenant) + sum(weight(t) for t in running)
        slots = sum(len(calls) for calls in running.values())
        best = None
        for tenant, calls in running.items():
            if len(calls) < 2 or len(calls) <= math.ceil(slots * weight(tenant) / total_weight - 1e-9):
                continue
            for key, entry in calls.items():
                if key[0] != partition and counts.get(key, 0) < limit and (best is None or entry[0] > best[1][1]) \
                        and (accept is None or accept(key)):
                    best = (key, (band, *entry))
        return best

    def _track_call(self, key, rank: int, tenant, entry: tuple) -> None:
        who = (rank, tenant)
        calls = self.by_tenant.get(who)
        if calls is None:
            calls = self.by_tenant[who] = {}
        calls[key] = entry
        self.tenant_of_call[key] = who
        if len(calls) == 2:
            self.crowded += 1

    def _forget_call(self, key) -> None:
        who = self.tenant_of_call.pop(key, None)
        if who is not None:
            calls = self.by_tenant[who]
            del calls[key]
            if len(calls) == 1:
                self.crowded -= 1
            elif not calls:
                del self.by_tenant[who]
