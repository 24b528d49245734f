"""The worker loop: consume requests, call the backend, publish responses, commit behind them.

One asyncio thread owns the consumer and the producer, so rebalance callbacks, delivery
callbacks and commits never race. The loop never blocks on the backend: calls run as
tasks (up to ``max_inflight``), and the loop keeps calling ``consume`` — with the
partitions paused when the worker is full — so a long LLM call never makes the group
evict the worker for missing ``max.poll.interval.ms``.

Taken requests wait in per-band queues; each turn the scheduler picks them, a chunk at a
time (never more than the free backend slots), and the chunk goes through decode, checks,
the backend and the answers stage by stage, its answers leaving in message order.

Delivery guarantee (at-least-once): a request's offset becomes committable only when the
broker has acknowledged its response (or its dead letter), and a partition commits only
up to its contiguous finished prefix. A crash therefore re-runs, never loses, requests;
each response carries the request_id so clients can drop duplicates.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from pipeline.cancellations import CancellationView
from pipeline.config import Settings
from pipeline.dlq import H_TRUNCATED, MAX_DEAD_LETTER_BYTES, dead_letter_headers
from pipeline.errors import BackendError, ConfigError, DecodeError, EncodeError, KafkaOperationError
from pipeline.models import BANDS, LOWEST_RANK, Priority, Request, Response, Status
from pipeline.observability.metrics import TenantLabels, WorkerMetrics, reason_code
from pipeline.policy.bands import BandScheduler
from pipeline.policy.validation import validate_request
from pipeline.serde import RESPONSE_FIELDS, Codec
from pipeline.serde.factory import codec_for
from pipeline.worker.backends.base import Backend, Completion
from pipeline.worker.backlog import PartitionQueues
from pipeline.worker.membership import apply_group_session
from pipeline.worker.offsets import OffsetTracker, decode_done

log = logging.getLogger(__name__)

_PARTITION_EOF = KafkaError._PARTITION_EOF
_PRODUCE_RETRY = (BufferError, KafkaException)  # a produce that the careful path (_produce) takes again


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class WorkerStats:
    consumed: int = 0
    completed: int = 0
    failed: int = 0
    expired: int = 0
    rejected: int = 0
    cancelled: int = 0
    dead_lettered: int = 0
    delivery_retries: int = 0
    commits: int = 0
    skipped_done: int = 0  # redelivered messages already answered (listed in commit metadata)
    rebalances: int = 0
    preempted: int = 0  # backend calls cancelled for a higher band's request (run again later)
    preempted_in_band: int = 0  # of those, calls of a tenant crowding its band (worker.fair_preemption)
    delivered: int = 0  # responses and dead letters the broker acknowledged (exactly-once: committed)
    first_consumed_at: float = 0.0  # time.perf_counter() of the first message
    last_delivered_at: float = 0.0


class Worker:
    def __init__(self, settings: Settings, backend: Backend, *, topics: list[str] | None = None,
                 codec: Codec | None = None, worker_id: str | None = None,
                 consumer_overrides: dict | None = None, producer_overrides: dict | None = None,
                 metrics: WorkerMetrics | None = None):
        self.settings = settings
        self.cfg = settings.worker
        self.backend = backend
        self.topics = topics or settings.topics.pool_topics(self.cfg.pool, self.cfg.source)
        self.group_id = self.cfg.effective_group_id()
        self.codec = codec or codec_for(settings.serde)
        self._wire = settings.serde.wire_format
        # Request ids answered recently by this worker: a re-submitted id is answered once.
        self._seen: set[str] = set()
        self._seen_order: deque[str] = deque()  # the same ids, oldest first (cheaper than an OrderedDict)
        self._seen_max = self.cfg.dedupe_window
        if self.cfg.static_membership and not (worker_id or self.cfg.worker_id):
            raise ConfigError("worker.worker_id", "static_membership needs a worker id that survives restarts "
                                                  "(a pod name); the default <hostname>-<pid> changes every time")
        self.worker_id = worker_id or self.cfg.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.responses_topic = settings.topics.responses
        self.dlq_topic = settings.topics.dlq
        self.stats = WorkerStats()
        self.metrics = metrics or WorkerMetrics(
            pool=self.cfg.pool, tenants=TenantLabels(self.cfg.metrics_tenants, self.cfg.metrics_tenant_top_n))
        # A dead letter has no decoded priority: its topic's band stands in.
        self._topic_band = {settings.topics.request_topic(p): p.value for p in Priority}
        self._slot_free = asyncio.Event()
        self.tracker = OffsetTracker()
        self._consumer_overrides = consumer_overrides or {}
        self._producer_overrides = producer_overrides or {}
        self._tasks: dict[tuple[tuple[str, int], int], asyncio.Task] = {}
        self._stop = threading.Event()
        self._paused = False
        self._assignment_changed = False
        # Priority-aware intake: taken messages wait in one queue per band (served partition
        # by partition in turn: tenants are spread over partitions); the scheduler picks the
        # band to serve next; a partition whose queue is full is paused, so librdkafka's
        # shared fetch queue never holds higher-band work behind it. Pausing a partition
        # rather than its whole band keeps a flooding tenant's partition from filling the
        # band's queue (tenant_fairness: quiet p99 ratio 1.2-1.4 this way, 1.1-7.5 pausing
        # bands). A partition is paused only if its queue is still at the cap after the free
        # slots are filled (see _pause_deep): librdkafka drops a paused partition's prefetched
        # messages and fetches them again.
        self._rank = {settings.topics.request_topic(p): p.rank for p in Priority}
        self._rank.update({f"{settings.topics.prefix}.dispatch.{p.value.lower()}": p.rank for p in Priority})
        self._backlog = [PartitionQueues() for _ in Priority]
        self._backlog_cap = max(2 * self.cfg.max_inflight, 64)  # per partition
        self._paused_parts: set[tuple[str, int]] = set()
        self._deep: set[tuple[str, int]] = set()  # reached the cap this turn: pause unless dispatch drained them
        self._scheduler = BandScheduler([self.cfg.band_min_share.get(p.value, 0.0) for p in Priority])
        self._fatal: KafkaOperationError | None = None
        self._last_commit = time.monotonic()
        self.consumer: Consumer | None = None
        self.producer: Producer | None = None
        self.cancellations: CancellationView | None = None
        self._task_of: dict[str, tuple] = {}  # request id → key in _tasks
        self._cancel_requested: set[tuple] = set()
        # Preemption (worker.preempt_bands), only of bands below another band this worker
        # consumes: a pool of BACKGROUND alone never preempts (nor polls faster for it).
        consumed = {self._rank[t] for t in self.topics if t in self._rank}
        self._preemptible = frozenset(r for r in (Priority[b].rank for b in self.cfg.preempt_bands)
                                      if r in consumed and any(c < r for c in consumed))
        # Running calls that may give their slot to a waiting request of a higher band:
        # key → (band rank, start order, message, task, request id).
        self._victims: dict[tuple, tuple] = {}
        self._preempted_tasks: set[asyncio.Task] = set()
        self._preempt_counts: dict[tuple, int] = {}  # key → times preempted so far
        self._starts = 0
        # Fairness inside a band (worker.fair_preemption): running calls by (band rank, tenant
        # key), each key → (start order, message, task, request id); how many run two or more.
        self._fair = self.cfg.fair_preemption
        self._by_tenant: dict[tuple, dict[tuple, tuple]] = {}
        self._tenant_of_call: dict[tuple, tuple] = {}  # key → (band rank, tenant key)
        self._crowded = 0
        self._owed: set[int] = set()  # id() of the messages of the chunk in hand started on a minimum share
        # Exactly-once: outcomes wait here until their partition's contiguous prefix reaches
        # them, then go out in one transaction with the offsets that cover them.
        self.exactly_once = self.cfg.delivery == "exactly-once"
        self._ready: dict[tuple, dict[int, tuple]] = {}
        # At-least-once: offsets the previous owner answered past its commit position, per partition.
        self._done_before: dict[tuple, set[int]] = {}
        self._restart = False
        # A transactional call may block the poll loop this long: well inside max.poll.interval.ms,
        # so a slow commit (broker restarting) never evicts the worker from its group.
        self._txn_call_budget_s = min(30.0, max(1.0, self.cfg.max_poll_interval_ms / 1000 / 3))

    # -- lifecycle ------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to stop (thread-safe, signal-safe)."""
        self._stop.set()

    def run(self, install_signals: bool = True) -> WorkerStats:
        """Run until :meth:`stop`, SIGTERM or SIGINT; then drain, commit and leave the group."""
        if install_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        asyncio.run(self._main())
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    async def _main(self) -> None:
        if self.cfg.group_protocol == "consumer":
            apply_group_session(self.settings, self.group_id)
        while True:
            await self._session()
            if not self._restart or self._stop.is_set() or self._fatal is not None:
                return
            # A transaction was aborted or the producer fenced: start over from the committed
            # offsets with fresh clients (the consumer does not rewind by itself).
            log.warning("restarting from the last committed offsets")
            self._reset()

    def _reset(self) -> None:
        self._restart = False
        self.tracker = OffsetTracker()
        self._backlog = [PartitionQueues() for _ in Priority]
        self._ready.clear()
        self._done_before.clear()
        self._tasks.clear()
        self._task_of.clear()
        self._victims.clear()
        self._preempted_tasks.clear()
        self._preempt_counts.clear()
        self._by_tenant.clear()
        self._tenant_of_call.clear()
        self._crowded = 0
        self._seen.clear()
        self._seen_order.clear()
        self._paused_parts.clear()
        self._deep.clear()
        self._paused = False

    async def _session(self) -> None:
        cfg = self.cfg
        producer_conf = {"client.id": f"llmq-worker-{self.worker_id}",
                         # room for a dead letter of the largest request the broker accepts, plus headers
                         "message.max.bytes": MAX_DEAD_LETTER_BYTES + 65536,
                         "linger.ms": cfg.producer_linger_ms}
        consumer_conf = {"client.id": f"llmq-worker-{self.worker_id}",
                         "max.poll.interval.ms": cfg.max_poll_interval_ms,
                         **cfg.membership_config(self.worker_id),
                         "on_commit": self._on_commit}
        if self.exactly_once:
            # A stable id per worker: a restarted worker fences its predecessor and aborts its
            # open transaction at once instead of after transaction.timeout.ms.
            producer_conf.update({"transactional.id": f"llmq-worker-{self.group_id}-{self.worker_id}",
                                  "transaction.timeout.ms": cfg.transaction_timeout_ms})
            consumer_conf["isolation.level"] = "read_committed"
        self.producer = Producer(self.settings.kafka.producer_config(**producer_conf, **self._producer_overrides))
        if self.exactly_once:
            self.producer.init_transactions(30)
        self.consumer = Consumer(self.settings.kafka.consumer_config(
            self.group_id, **consumer_conf, **self._consumer_overrides))
        self.consumer.subscribe(self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
                                on_lost=self._on_lost)
        self.cancellations = CancellationView(self.settings)
        log.info("worker %s consuming %s as group %s (backend %s, max in flight %d)",
                 self.worker_id, ", ".join(self.topics), self.group_id, self.backend.name, cfg.max_inflight)
        up = self.metrics.up.labels(self.metrics.pool)
        up.set(1)
        try:
            await self._consume_until_stopped()
            if not self._restart:
                await self._drain(cfg.shutdown_grace_s)
            else:
                for task in list(self._tasks.values()):
                    task.cancel()
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        finally:
            up.set(0)
            self._close()
            await self.backend.close()

    async def _consume_until_stopped(self) -> None:
        consumer, producer, cfg = self.consumer, self.producer, self.cfg
        idle_s = cfg.idle_poll_ms / 1000.0
        commit_every = cfg.commit_interval_ms / 1000.0
        batch = cfg.batch_size
        take, dispatch = self._take_many, self._dispatch
        session_s = cfg.session_timeout_ms / 1000.0
        last_turn = time.monotonic()
        hold_until = 0.0
        wait_in_poll = False  # idle with nothing in flight: the next poll waits for a message itself
        while not self._stop.is_set() and self._fatal is None and not self._restart:
            now = time.monotonic()
            if now - last_turn > session_s:
                # Frozen (SIGSTOP, a VM pause, a long GC) past the session timeout: the group
                # has most likely given our partitions away. Start nothing new until librdkafka
                # has told us (on_lost / on_revoke drop that work); a zombie answering its
                # whole backlog would only make duplicates.
                log.warning("this worker stood still for %.1f s, longer than session.timeout.ms; holding new work "
                            "for %.0f s until the group says which partitions are still ours",
                            now - last_turn, _FROZEN_HOLD_S)
                hold_until = now + _FROZEN_HOLD_S
            last_turn = now
            # Always poll: it serves rebalances and keeps max.poll.interval.ms satisfied, even
            # while every backend slot is busy (full bands are paused, so nothing piles up).
            msgs = consumer.consume(batch, 0)
            if not msgs and wait_in_poll:
                # librdkafka wakes this as soon as a message arrives, where a sleep of idle_s
                # would add up to idle_s to its wait (about half of it on average). Blocking the
                # event loop costs nothing here: no backend call is in flight.
                msgs = consumer.consume(1, idle_s)
                if msgs and batch > 1:
                    msgs += consumer.consume(batch - 1, 0)
            wait_in_poll = False
            if self._assignment_changed:
                self._assignment_changed = False
                self._reapply_pauses()
            if msgs:
                take(msgs)
            for request_id in self.cancellations.poll():
                self._cancel_in_flight(request_id)
            dispatched = dispatch() if now >= hold_until else 0
            if self._deep:
                self._pause_deep()
            self._resume_drained()
            producer.poll(0)
            if now - self._last_commit >= commit_every:
                self._commit(asynchronous=True)
            if len(self._tasks) >= cfg.max_inflight:
                self._slot_free.clear()
                try:
                    # With preemptible calls running, a higher band's request that arrives
                    # is looked for sooner: it need not wait for a slot, only to be seen.
                    await asyncio.wait_for(self._slot_free.wait(),
                                           _PREEMPT_POLL_S if self._victims and idle_s > _PREEMPT_POLL_S else idle_s)
                except asyncio.TimeoutError:
                    pass
            elif not msgs and not dispatched:
                if self._tasks:
                    await asyncio.sleep(idle_s)
                else:
                    wait_in_poll = True
                    await asyncio.sleep(0)
            elif self._tasks:
                await asyncio.sleep(0)

    def _take_many(self, msgs: list) -> None:
        """:meth:`_take` each of ``msgs`` (one consume's worth), the common case inline."""
        started, rank, backlog, cap, deep = (self.tracker.started, self._rank, self._backlog, self._backlog_cap,
                                             self._deep)
        for msg in msgs:
            if msg.error() is not None or self._done_before:
                self._take(msg)  # errors, and the first messages after a rebalance: the whole story
                continue
            topic = msg.topic()
            tp = (topic, msg.partition())
            started(tp, msg.offset())
            if backlog[rank.get(topic, LOWEST_RANK)].append(tp, msg) >= cap:
                deep.add(tp)

    def _take(self, msg) -> None:
        """Accept a consumed message into its band's queue (its offset now holds commits back)."""
        err = msg.error()
        if err is not None:
            if err.code() != _PARTITION_EOF:
                log.warning("consumer error: %s", err)
                if err.fatal():
                    self._fatal = KafkaOperationError("consume", err.str(), err)
            return
        topic = msg.topic()
        tp = (topic, msg.partition())
        offset = msg.offset()
        self.tracker.started(tp, offset)
        if self._done_before:
            done = self._done_before.get(tp)
            if done is not None and offset in done:
                # Answered by the partition's previous owner after its last commit position
                # (its commit said so): finished already, not a second time.
                done.discard(offset)
                if not done:
                    del self._done_before[tp]
                self.stats.skipped_done += 1
                self.tracker.finished(tp, offset)
                return
        if self._backlog[self._rank.get(topic, LOWEST_RANK)].append(tp, msg) >= self._backlog_cap:
            self._deep.add(tp)

    def _dispatch(self) -> int:
        """Start queued requests, highest band first (minimum shares aside), while slots are free.

        Requests are picked a chunk at a time, at most as many as there are free slots (each
        takes at most one), and the chunk is processed stage by stage (:meth:`_process_batch`).
        Picking ahead changes nothing: nothing is taken during dispatch and processing does
        not touch the queues or the scheduler, so the picks come out as they would one by one.
        """
        backlog, tasks, limit = self._backlog, self._tasks, self.cfg.max_inflight
        pick, record, process = self._scheduler.pick, self._scheduler.record, self._process_batch
        owed = self._owed
        n = 0
        while True:
            room = limit - len(tasks)
            if room <= 0:
                if (self._victims or self._crowded) and self._preempt():
                    continue
                break
            if room > _DISPATCH_CHUNK:
                room = _DISPATCH_CHUNK
            chunk = []
            while len(chunk) < room:
                busy = [q.size > 0 for q in backlog]
                band = pick(busy)
                if band is None:
                    break
                if busy.count(True) == 1:
                    # The only band with work: every pick would choose it.
                    queue = backlog[band]
                    while queue.size and len(chunk) < room:
                        record(band)
                        chunk.append(queue.popleft())
                    continue
                record(band)
                msg = backlog[band].popleft()
                if band != busy.index(True):
                    # Started on its band's minimum share: preempting it would take back the
                    # share the scheduler has just counted as given.
                    owed.add(id(msg))
                chunk.append(msg)
            if not chunk:
                break
            process(chunk)
            owed.clear()
            n += len(chunk)
        return n

    def _preempt(self) -> bool:
        """Every slot is busy: cancel one running call of a preemptible band lower than the
        band the scheduler would serve next, and put its message back at the head of its
        partition's queue. Returns whether a slot was freed.

        The victim is the most recently started call of the lowest such band (the least work
        thrown away). Its offset stays taken and unfinished, so nothing is committed past it,
        and it is answered once, when it runs again. Failing such a call, one of a tenant
        crowding the served band (:meth:`_crowding_call`), which waits behind the request it
        made way for.
        """
        backlog = self._backlog
        band = self._scheduler.pick([q.size > 0 for q in backlog])
        if band is None:
            return False
        victim = None
        for key, entry in self._victims.items():
            if entry[0] > band and (victim is None or entry[:2] > victim[1][:2]):
                victim = (key, entry)
        turn_first = True
        if victim is None:
            victim = self._crowding_call(band) if self._crowded else None
            if victim is None:
                return False
            turn_first = False
            self.stats.preempted_in_band += 1
        key, (rank, _, msg, task, request_id) = victim
        self._victims.pop(key, None)
        self._forget_call(key)
        self._tasks.pop(key, None)
        self._preempted_tasks.add(task)
        task.cancel()
        self._preempt_counts[key] = self._preempt_counts.get(key, 0) + 1
        backlog[rank].appendleft(key[0], msg, turn_first=turn_first)
        # It is taken again when it runs again: not a second request, not a duplicate id.
        self.stats.consumed -= 1
        self.stats.preempted += 1
        self._task_of.pop(request_id, None)
        self._seen.discard(request_id)
        self.metrics.preemptions.labels(BANDS[rank].value).inc()
        return True

    def _crowding_call(self, band: int):
        """When the request ``band`` serves next is of a tenant running no call in that band
        while another tenant runs two or more there: the latest-started of those calls that may
        still be preempted, as (key, (band, start order, message, task, request id)), else None.

        A call from the waiting request's own partition is never chosen: it would go back
        ahead of the request and be taken again in its place.
        """
        head = self._backlog[band].peek()
        tenant = head.key()
        if tenant is None or (band, tenant) in self._by_tenant:
            return None
        partition = (head.topic(), head.partition())
        limit, counts = self.cfg.max_preemptions, self._preempt_counts
        best = None
        for (rank, _), calls in self._by_tenant.items():
            if rank != band or len(calls) < 2:
                continue
            for key, entry in calls.items():
                if key[0] != partition and counts.get(key, 0) < limit and (best is None or entry[0] > best[1][1]):
                    best = (key, (band, *entry))
        return best

    def _track_call(self, key, rank: int, tenant, entry: tuple) -> None:
        who = (rank, tenant)
        calls = self._by_tenant.get(who)
        if calls is None:
            calls = self._by_tenant[who] = {}
        calls[key] = entry
        self._tenant_of_call[key] = who
        if len(calls) == 2:
            self._crowded += 1

    def _forget_call(self, key) -> None:
        who = self._tenant_of_call.pop(key, None)
        if who is not None:
            calls = self._by_tenant[who]
            del calls[key]
            if len(calls) == 1:
                self._crowded -= 1
            elif not calls:
                del self._by_tenant[who]

    def _pause_deep(self) -> None:
        """Pause the partitions whose queue is still at its cap once the free slots are filled.

        Decided after dispatch, not as messages are taken: one fetch brings hundreds of a
        partition's messages at once, and a fast backend clears them in the same turn; pausing
        on the way in would make librdkafka drop the rest of that fetch and fetch it again.
        """
        cap, backlog, rank = self._backlog_cap, self._backlog, self._rank
        for tp in self._deep:
            if backlog[rank.get(tp[0], LOWEST_RANK)].depth(tp) >= cap:
                self._set_paused(tp, True)
        self._deep.clear()

    def _resume_drained(self) -> None:
        """Resume the paused partitions whose queue is down to half its cap."""
        if not self._paused_parts or self._paused:
            return
        half, backlog, rank = self._backlog_cap // 2, self._backlog, self._rank
        for tp in [tp for tp in self._paused_parts if backlog[rank.get(tp[0], LOWEST_RANK)].depth(tp) <= half]:
            self._set_paused(tp, False)

    def _set_paused(self, tp: tuple[str, int], paused: bool) -> None:
        if paused == (tp in self._paused_parts):
            return
        if paused:
            self._paused_parts.add(tp)
        else:
            self._paused_parts.discard(tp)
        # Only an assigned partition has a flag to set; one assigned later gets it from
        # _reapply_pauses.
        if self._paused or not any(a.topic == tp[0] and a.partition == tp[1] for a in self.consumer.assignment()):
            return
        (self.consumer.pause if paused else self.consumer.resume)([TopicPartition(*tp)])

    def _reapply_pauses(self) -> None:
        """Make librdkafka's pause flags match ours for whatever is assigned now.

        Both directions matter: a newly assigned partition starts unpaused, but one that comes
        back after being revoked or lost keeps the flag it had (librdkafka remembers it per
        partition), and a band resumed while it was away must not stay paused forever.
        """
        assignment = self.consumer.assignment()
        if not assignment:
            return
        if self._paused:
            self.consumer.pause(assignment)
            return
        paused, running = [], []
        for tp in assignment:
            (paused if (tp.topic, tp.partition) in self._paused_parts else running).append(tp)
        if paused:
            self.consumer.pause(paused)
        if running:
            self.consumer.resume(running)

    def _apply_flow_control(self, want_running: bool, force: bool = False) -> None:
        if want_running == (not self._paused) and not force:
            return
        assignment = self.consumer.assignment()
        if want_running:
            if self._paused and assignment:
                self.consumer.resume(assignment)
            self._paused = False
        else:
            if assignment:
                self.consumer.pause(assignment)
            self._paused = True

    # -- per message ----------------------------------------------------------------------

    def _handle(self, msg) -> None:
        """Take one message and process it at once (no band scheduling): tests and tools."""
        self._take(msg)
        if msg.error() is None:
            self._backlog[self._rank.get(msg.topic(), LOWEST_RANK)].pop_last((msg.topic(), msg.partition()))
            self._process(msg)

    def _process(self, msg) -> None:
        self._process_batch([msg])

    def _process_batch(self, msgs: list) -> None:
        """Run taken messages through decoding, checks, the backend and the answer, one stage
        at a time over the whole chunk: each stage's code and data stay warm in the CPU's
        caches, which makes a stage-by-stage pass markedly cheaper than message by message.

        Every message still ends in exactly one outcome: a dead letter, a rejection,
        CANCELLED, EXPIRED, a COMPLETED answer (``complete_now``), or a backend task.
        """
        stats = self.stats
        if not stats.consumed:
            stats.first_consumed_at = time.perf_counter()
        stats.consumed += len(msgs)
        decode = self.codec.decode_request
        decoded = []
        for msg in msgs:
            value = msg.value()
            try:
                if not value:
                    raise DecodeError("empty", "message has no value (empty or tombstone)")
                decoded.append((msg, decode(value)))
            except DecodeError as exc:
                self._dead_letter(msg, (msg.topic(), msg.partition()), msg.offset(), exc.reason, str(exc))
        started = _now_ms()
        cancellations = self.cancellations
        duplicate = self._duplicate
        # Answers go out in message order (a client waiting on a re-submitted id must see the
        # first submission's answer first): message by message, either a deferred answer
        # (a callable) or [msg, request, answer, its index] whose answer the backend stage
        # fills in (or replaces by a FAILED one).
        outcomes: list = []
        runnable = []
        for msg, request in decoded:
            invalid = validate_request(request, started)
            if invalid is None:
                invalid = duplicate(request.request_id)
            if invalid is not None:
                outcomes.append(functools.partial(self._reject, msg, request, invalid))
                continue
            if cancellations is not None:
                cancelled = cancellations.reason(request.request_id)
                if cancelled is not None:
                    outcomes.append(functools.partial(self._respond_cancelled, (msg.topic(), msg.partition()),
                                                      msg.offset(), request, started, cancelled))
                    continue
            if request.created_at + request.timeout_ms <= started:
                outcomes.append(functools.partial(self._expire, msg, request, started))
                continue
            entry = [msg, request, None, len(outcomes)]
            outcomes.append(entry)
            runnable.append(entry)
        done = []
        if runnable:
            counts = self._preempt_counts
            # A preempted request's wait was observed when it first started: once per request.
            self.metrics.waited_many([e for e in runnable if ((e[0].topic(), e[0].partition()), e[0].offset())
                                      not in counts] if counts else runnable, started)
            complete_now = self.backend.complete_now
            for entry in runnable:
                msg, request = entry[0], entry[1]
                try:
                    completion = complete_now(request)
                except Exception as exc:  # answered FAILED in its place, like a failed backend call
                    outcomes[entry[3]] = functools.partial(self._backend_failed, (msg.topic(), msg.partition()),
                                                           msg.offset(), request, started, exc)
                    continue
                if completion is not None:
                    entry[2] = item = ((msg.topic(), msg.partition()), msg.offset(), request, completion)
                    done.append(item)
                else:
                    tp, offset = (msg.topic(), msg.partition()), msg.offset()
                    key = (tp, offset)
                    self._tasks[key] = task = asyncio.get_running_loop().create_task(
                        self._call_backend(tp, offset, request, started))
                    self._task_of[request.request_id] = key
                    rank = self._rank.get(tp[0], LOWEST_RANK)
                    self._starts += 1
                    if rank in self._preemptible and id(msg) not in self._owed and \
                            self._preempt_counts.get(key, 0) < self.cfg.max_preemptions:
                        self._victims[key] = (rank, self._starts, msg, task, request.request_id)
                    if self._fair:
                        tenant = msg.key()
                        if tenant is not None:
                            self._track_call(key, rank, tenant, (self._starts, msg, task, request.request_id))
        if len(done) == len(outcomes):
            if done:
                self._respond_completed_many(done, started)
        else:
            self._respond_in_order(outcomes, started)

    def _respond_in_order(self, outcomes: list, started: int) -> None:
        """The chunk's answers in message order: the deferred ones called, the runs of
        completed ones between them answered together."""
        run: list = []
        for item in outcomes:
            if callable(item):
                if run:
                    self._respond_completed_many(run, started)
                    run = []
                item()
            elif item[2] is not None:
                run.append(item[2])
        if run:
            self._respond_completed_many(run, started)

    def _reject(self, msg, request: Request, reason: str) -> None:
        band = request.priority._value_
        self.stats.rejected += 1
        self.metrics.outcome(band, "rejected")
        self.metrics.rejections.labels(band, reason_code(reason)).inc()
        self._respond((msg.topic(), msg.partition()), msg.offset(),
                      _answer(request, Status.REJECTED, self.worker_id, reason=reason))

    def _expire(self, msg, request: Request, started: int) -> None:
        self.stats.expired += 1
        self.metrics.outcome(request.priority._value_, "expired")
        self._respond((msg.topic(), msg.partition()), msg.offset(), _answer(
            request, Status.EXPIRED, self.worker_id, started_at=started,
            reason="deadline_passed: the request's timeout ran out before a worker took it"))

    def _cancel_in_flight(self, request_id: str) -> None:
        key = self._task_of.get(request_id)
        task = self._tasks.get(key) if key is not None else None
        if task is not None and not task.done():
            self._cancel_requested.add(key)
            task.cancel()

    def _respond_cancelled(self, tp, offset: int, request: Request, started: int, reason: str) -> None:
        self.stats.cancelled += 1
        self.metrics.outcome(request.priority._value_, "cancelled")
        self._respond(tp, offset, _answer(
            request, Status.CANCELLED, self.worker_id, reason=f"cancelled: {reason}", started_at=started))

    def _duplicate(self, request_id: str) -> str | None:
        seen = self._seen
        if request_id in seen:
            return ("duplicate_request_id: this request id was already taken by this worker; the first "
                    "submission is answered")
        seen.add(request_id)
        order = self._seen_order
        order.append(request_id)
        if len(order) > self._seen_max:
            seen.discard(order.popleft())
        return None

    async def _call_backend(self, tp, offset: int, request: Request, started: int) -> None:
        self.metrics.inflight_child.inc()
        t0 = time.perf_counter()
        key = (tp, offset)
        try:
            completion = await self.backend.complete(request)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me in self._preempted_tasks:  # back in its queue (_preempt): no answer now
                self._preempted_tasks.discard(me)
                return
            if (tp, offset) in self._cancel_requested:  # the client cancelled it: answer that
                self._cancel_requested.discard((tp, offset))
                self._respond_cancelled(tp, offset, request, started,
                                        self.cancellations.reason(request.request_id) or "cancelled")
                return
            # Handed back (shutdown or revocation): the offset stays uncommitted, so the
            # partition's next owner runs the request.
            raise
        except Exception as exc:  # a backend bug must not lose the request
            self._backend_failed(tp, offset, request, started, exc)
        else:
            self._respond_completed(tp, offset, request, started, completion, time.perf_counter() - t0)
        finally:
            self.metrics.inflight_child.dec()
            me = asyncio.current_task()
            # A preempted call's key may already belong to its next run.
            if self._tasks.get(key) is me:
                del self._tasks[key]
                if self._task_of.get(request.request_id) == key:
                    del self._task_of[request.request_id]
                victim = self._victims.get(key)
                if victim is not None and victim[3] is me:
                    del self._victims[key]
                self._forget_call(key)
                self._preempt_counts.pop(key, None)
            self._slot_free.set()

    def _backend_failed(self, tp, offset: int, request: Request, started: int, exc: Exception) -> None:
        """The FAILED answer to a request whose backend call raised ``exc``."""
        if isinstance(exc, BackendError):
            reason = f"backend_error: {exc}"
        else:  # a bug in the backend: the request still gets its one answer
            log.error("backend %s crashed on request %s", self.backend.name, request.request_id, exc_info=exc)
            reason = f"backend_error: {type(exc).__name__}: {exc}"
        self.stats.failed += 1
        self.metrics.outcome(request.priority._value_, "failed")
        self._respond(tp, offset, _answer(request, Status.FAILED, self.worker_id, reason=reason, started_at=started,
                                          model=request.model))

    def _respond_completed(self, tp, offset: int, request: Request, started: int, c: Completion,
                           seconds: float = 0.0) -> None:
        self._respond_completed_many([(tp, offset, request, c)], started, seconds)

    def _respond_completed_many(self, done: list, started: int, seconds: float = 0.0) -> None:
        """The COMPLETED answers of ``done`` ``(tp, offset, request, completion)``, the
        backend having taken ``seconds`` for each (0 for answers it gave at once)."""
        self.stats.completed += len(done)
        self.metrics.completed_many(done, seconds)
        finished = _now_ms()
        encode, wire, topic, worker_id = self.codec.encode_response_values, self._wire, self.responses_topic, self.worker_id
        exactly_once, ready, finish = self.exactly_once, self._ready, self.tracker.finished
        produce, delivered, partial = self.producer.produce, self._delivered, functools.partial
        completed = Status.COMPLETED
        for tp, offset, request, c in done:
            # RESPONSE_FIELDS order; the gateway fields are copied as _answer copies them.
            values = (request.request_id, request.tenant_id, completed, None, c.output, c.prompt_tokens,
                      c.completion_tokens, c.model, request.degraded_from is not None, request.priority,
                      request.effective_priority or request.priority, request.created_at, request.admitted_at,
                      started, finished, worker_id, None,
                      {"trace_id": request.trace_id} if request.trace_id else {}, None, None)
            try:
                value = encode(values, wire, topic)
            except EncodeError as exc:
                value = self._fallback(Response(**dict(zip(RESPONSE_FIELDS, values))), f"response_too_large: {exc}")
            if exactly_once:
                part = ready.get(tp)
                if part is None:
                    part = ready[tp] = {}
                part[offset] = (topic, value, request.tenant_id.encode(), None)
                finish(tp, offset)
            else:
                on_delivery = partial(delivered, tp, offset)
                try:
                    produce(topic, value, request.tenant_id.encode(), on_delivery=on_delivery)
                except (BufferError, KafkaException):  # queue full, or too large: the careful path
                    self._produce(topic, value, request.tenant_id.encode(), None, on_delivery)

    def _respond(self, tp, offset: int, response: Response) -> None:
        try:
            value = self.codec.encode_response(response, self._wire, self.responses_topic)
        except EncodeError as exc:
            # An answer over the size caps (say, a runaway model output) must still end in a
            # response: a FAILED one without the output.
            value = self._fallback(response, f"response_too_large: {exc}")
        self._emit(tp, offset, self.responses_topic, value, response.tenant_id.encode(), None)

    def _emit(self, tp, offset: int, topic: str, value, key, headers) -> None:
        """Publish the one outcome of the message at ``tp``/``offset``."""
        if self.exactly_once:
            self._ready.setdefault(tp, {})[offset] = (topic, value, key, headers)
            self.tracker.finished(tp, offset)
        else:
            self._produce(topic, value, key, headers, functools.partial(self._delivered, tp, offset))

    def _fallback(self, response: Response, reason: str) -> bytes:
        log.warning("request %s answered FAILED: %s", response.request_id, reason)
        self.stats.failed += 1
        self.metrics.outcome(response.requested_priority._value_, "failed")
        failed = Response(
            request_id=response.request_id, tenant_id=response.tenant_id, status=Status.FAILED, reason=reason[:500],
            model=None, degraded=response.degraded, requested_priority=response.requested_priority,
            served_priority=response.served_priority,
            created_at=response.created_at, admitted_at=response.admitted_at, started_at=response.started_at,
            finished_at=_now_ms(), worker_id=self.worker_id)
        return self.codec.encode_response(failed, self._wire, self.responses_topic)

    def _dead_letter(self, msg, tp, offset: int, reason: str, error: str) -> None:
        self.stats.dead_lettered += 1
        self.metrics.dead_letters.labels(reason).inc()
        self.metrics.outcome(self._topic_band.get(tp[0], "UNKNOWN"), "dead_lettered")
        log.warning("dead-lettering %s[%d]@%d: %s", tp[0], tp[1], offset, error)
        headers = dead_letter_headers(tp[0], tp[1], offset, reason, error, "worker", msg.headers())
        self._emit(tp, offset, self.dlq_topic, msg.value(), msg.key(), headers)

    def _produce(self, topic: str, value, key, headers, on_delivery) -> None:
        while True:
            try:
                self.producer.produce(topic, value, key, headers=headers, on_delivery=on_delivery)
                return
            except BufferError:
                # Local queue full: serve delivery reports until there is room.
                self.producer.poll(0.05)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                    raise
                topic, value, key, headers = self._shrunk(topic, value, key, headers)

    def _shrunk(self, topic: str, value, key, headers):
        """A message the broker or producer refuses as too large, made small enough to publish.

        A dead letter keeps the head of the original value and says how long it was; a
        response becomes a FAILED response without its output. Either way the request
        still ends in exactly one outcome and the partition moves on.
        """
        if topic == self.dlq_topic:
            own = [(k, v) for k, v in (headers or []) if k.startswith("llmq.dlq.")]
            size = len(value or b"") + len(key or b"") + sum(len(k) + len(v or b"") for k, v in (headers or []))
            log.warning("dead letter of %d bytes exceeds the size limit; keeping its first 64 KiB", size)
            return topic, (value or b"")[:65536], (key or b"")[:1024], own + [(H_TRUNCATED, str(size).encode())]
        response = self.codec.decode_response(value)
        return topic, self._fallback(response, "response_too_large: the broker refused its size"), key, None

    def _delivered(self, tp, offset: int, err, msg) -> None:
        if err is None:
            self.tracker.finished(tp, offset)
            stats = self.stats
            stats.delivered += 1
            stats.last_delivered_at = time.perf_counter()
            return
        self._not_delivered(err, msg, functools.partial(self._delivered, tp, offset), f"{tp[0]}[{tp[1]}]@{offset}")

    def _not_delivered(self, err, msg, on_delivery, what: str) -> None:
        """A message the broker did not acknowledge: publish it again, smaller if it was too
        large, or stop on a fatal error; its offset is not committed meanwhile."""
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
            self._produce(*self._shrunk(msg.topic(), msg.value(), msg.key(), msg.headers()), on_delivery)
            return
        if err.fatal():
            self._fatal = KafkaOperationError("produce response", err.str(), err)
            log.error("fatal producer error, stopping without committing %s: %s", what, err)
            return
        # Not acknowledged: never commit past it; publish again (idempotent producer).
        self.stats.delivery_retries += 1
        log.warning("response for %s not delivered (%s); retrying", what, err)
        self._produce(msg.topic(), msg.value(), msg.key(), msg.headers(), on_delivery)

    # -- commits and rebalances -----------------------------------------------------------

    def _commit(self, asynchronous: bool, only: set | None = None) -> None:
        self._last_commit = time.monotonic()
        if self.exactly_once:
            self._commit_transaction()
            return
        # Each commit also lists the offsets finished past its position, so a slow message at
        # a partition's head does not make its next owner redo everything behind it.
        positions = self.tracker.to_commit_with_done(only)
        if not positions:
            return
        offsets = [TopicPartition(t, p, pos, done) for (t, p), pos, done in positions]
        try:
            self.consumer.commit(offsets=offsets, asynchronous=asynchronous)
        except KafkaException as exc:
            err = exc.args[0]
            # No assignment any more / rebalance in progress: the next owner starts from the
            # last successful commit, which only means redelivery.
            log.warning("commit failed (%s); those requests may be redelivered", err)
            return
        self.tracker.mark_committed_with_done(positions)
        self.stats.commits += 1
        if not asynchronous:
            self.metrics.last_commit.labels(self.metrics.pool).set(time.time())

    def _commit_transaction(self) -> None:
        """One transaction: the outcomes covered by each partition's new position, and the positions."""
        if self._restart or self.consumer is None:
            return
        positions = self.tracker.to_commit()
        if not positions:
            return
        producer = self.producer
        produced = 0
        offsets = [TopicPartition(t, p, pos) for (t, p), pos in positions]
        group_metadata = self.consumer.consumer_group_metadata()
        budget = self._txn_call_budget_s

        def send_offsets_and_commit():
            producer.send_offsets_to_transaction(offsets, group_metadata, budget)
            producer.commit_transaction(budget)

        try:
            producer.begin_transaction()
            produce = producer.produce
            for tp, position in positions:
                ready = self._ready.get(tp)
                if not ready:
                    continue
                for off in sorted(o for o in ready if o < position):
                    topic, value, key, headers = ready.pop(off)
                    try:
                        if headers is None:
                            produce(topic, value, key)
                        else:
                            produce(topic, value, key, headers=headers)
                    except (BufferError, KafkaException):  # queue full, or too large: the careful path
                        self._produce(topic, value, key, headers, None)
                    produced += 1
            _bounded_call(send_offsets_and_commit, budget)
        except _CallHung:
            self._abandon_producer("the transaction commit")
            return
        except KafkaException as exc:
            err = exc.args[0]
            log.warning("transaction failed (%s); aborting and restarting from committed offsets", err)
            if not err.fatal():
                try:
                    _bounded_call(lambda: producer.abort_transaction(budget), budget)
                except _CallHung:
                    self._abandon_producer("the transaction abort")
                    return
                except KafkaException as abort_exc:
                    log.warning("abort failed too: %s", abort_exc)
            self._restart = True
            return
        self.tracker.mark_committed(positions)
        stats = self.stats
        stats.commits += 1
        stats.delivered += produced
        stats.last_delivered_at = time.perf_counter()
        self.metrics.last_commit.labels(self.metrics.pool).set(time.time())

    def _abandon_producer(self, what: str) -> None:
        """A transactional call outlived its timeout: librdkafka can block forever in
        send_offsets_to_transaction while the group coordinator is unreachable (librdkafka
        #5456, #5511). Leave that producer to its stuck thread, never to be flushed or
        destroyed here, and restart: the next producer, with the same transactional.id,
        fences it, which aborts its open transaction on the broker."""
        log.error("%s did not return within %.0f s (broker unreachable?); abandoning the producer and "
                  "restarting from the committed offsets", what, self._txn_call_budget_s)
        _ABANDONED_PRODUCERS.append(self.producer)
        self.producer = None
        self._restart = True
        if len(_ABANDONED_PRODUCERS) >= MAX_ABANDONED_PRODUCERS:
            # Each one keeps its threads, buffers and connections for the life of the process:
            # past a few, a clean restart by the supervisor costs less than running on.
            self._fatal = KafkaOperationError(
                what, f"{len(_ABANDONED_PRODUCERS)} producers abandoned in stuck transactional calls; stopping "
                      "so that a restarted process frees them (nothing is lost: offsets stay uncommitted)")

    def _on_commit(self, err, partitions) -> None:
        if err is None:
            self.metrics.last_commit.labels(self.metrics.pool).set(time.time())
            return
        if err.code() == KafkaError._NO_OFFSET:
            return
        # Retried at the next commit interval (or at revoke/shutdown); failures during a
        # rebalance are routine, anything else deserves a warning.
        self.tracker.commit_failed([((p.topic, p.partition), p.offset) for p in partitions])
        routine = err.code() in (KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION,
                                 KafkaError.UNKNOWN_MEMBER_ID)
        log.log(logging.INFO if routine else logging.WARNING, "asynchronous commit failed, will retry: %s", err)

    def _on_assign(self, consumer, partitions) -> None:
        self.stats.rebalances += 1
        self.metrics.rebalances.labels(self.metrics.pool).inc()
        self._assignment_changed = True
        log.info("assigned %s", _fmt(partitions))
        if not self.exactly_once and partitions:
            self._load_done_before(consumer, partitions)

    def _load_done_before(self, consumer, partitions) -> None:
        """Offsets past each committed position that were already answered (commit metadata)."""
        try:
            committed = consumer.committed(partitions, timeout=10)
        except KafkaException as exc:
            log.info("could not read commit metadata (%s); finished requests may be answered twice", exc)
            return
        skipped = 0
        for tp in committed:
            done = decode_done(tp.offset, tp.metadata)
            key = (tp.topic, tp.partition)
            if done:
                self._done_before[key] = done
                skipped += len(done)
            else:
                self._done_before.pop(key, None)
        if skipped:
            log.info("%d requests past the committed offsets were answered before; skipping them", skipped)

    def _on_revoke(self, consumer, partitions) -> None:
        self.stats.rebalances += 1
        # Their uncommitted requests go to another member, or come back here: not duplicates.
        self._seen.clear()
        self._seen_order.clear()
        self.metrics.rebalances.labels(self.metrics.pool).inc()
        self._assignment_changed = True
        revoked = {(p.topic, p.partition) for p in partitions}
        log.info("revoked %s", _fmt(partitions))
        # Hand back in-flight work of revoked partitions: its offsets stay uncommitted.
        for key, task in list(self._tasks.items()):
            if key[0] in revoked:
                task.cancel()
                self._tasks.pop(key, None)
        self._drop_queued(revoked)
        for tp in revoked:
            self._done_before.pop(tp, None)
        # Publish and acknowledge what is finished, commit it, then let the partitions go.
        if self.producer is not None:  # None once abandoned: nothing can be committed then
            self.producer.flush(10)
        self._commit(asynchronous=False, only=revoked)
        for tp in revoked:
            self.tracker.forget(tp)
            # Exactly-once outcomes past the committed position are not ours to publish any
            # more: the next owner redoes them. Kept, they would go out if the partition came
            # back, after the other owner had already answered them.
            self._ready.pop(tp, None)

    def _on_lost(self, consumer, partitions) -> None:
        # Lost, not revoked: another member may already own them, so committing is pointless.
        self._assignment_changed = True
        log.warning("lost %s (session timed out?)", _fmt(partitions))
        lost = {(p.topic, p.partition) for p in partitions}
        for key, task in list(self._tasks.items()):
            if key[0] in lost:
                task.cancel()
                self._tasks.pop(key, None)
        self._drop_queued(lost)
        for tp in lost:
            self.tracker.forget(tp)
            self._ready.pop(tp, None)
            self._done_before.pop(tp, None)

    def _drop_queued(self, partitions: set) -> None:
        # Taken but not started: uncommitted, so the partitions' next owner runs them.
        for queue in self._backlog:
            queue.drop(partitions)
        self._paused_parts -= set(partitions)
        for table in (self._victims, self._preempt_counts):
            for key in [key for key in table if key[0] in partitions]:
                del table[key]
        for key in [key for key in self._tenant_of_call if key[0] in partitions]:
            self._forget_call(key)

    async def _drain(self, grace_s: float) -> None:
        """Stop fetching, let in-flight calls finish within the grace period, hand back the rest."""
        if self.consumer is None:
            return
        self._apply_flow_control(False, force=True)
        deadline = time.monotonic() + grace_s
        if self._tasks:
            log.info("draining %d in-flight requests (grace %.1fs)", len(self._tasks), grace_s)
        while self._tasks and time.monotonic() < deadline and self._fatal is None:
            self.consumer.consume(1, 0)  # keeps group membership alive; partitions are paused
            self.producer.poll(0)
            await asyncio.sleep(0.01)
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            log.info("handing back %d unfinished requests", len(self._tasks))
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        remaining = self.producer.flush(30)
        if remaining:
            log.error("%d responses still unacknowledged at shutdown; their requests will be redelivered", remaining)

    def _close(self) -> None:
        if self.consumer is not None:
            if self._fatal is None and not self._restart:
                self._commit(asynchronous=False)
            try:
                self.consumer.close()  # leaves the group now instead of after session timeout
            except (KafkaException, RuntimeError) as exc:
                log.warning("closing consumer: %s", exc)
            self.consumer = None
        if self.producer is not None:
            self.producer.flush(10)
            self.producer = None
        if self.cancellations is not None:
            self.cancellations.close()
            self.cancellations = None
        log.info("worker %s stopped: %s", self.worker_id, self.stats)


# Requests processed stage by stage at a time (fewer if fewer backend slots are free).
_DISPATCH_CHUNK = 64

# How often a worker whose slots are all busy looks for new requests while some of its calls
# are preemptible (otherwise worker.idle_poll_ms): each look is one non-blocking consume.
_PREEMPT_POLL_S = 0.001

# After a freeze longer than the session timeout, how long a worker starts no new work: enough
# for librdkafka to notice the expired session and report the lost partitions.
_FROZEN_HOLD_S = 4.0


class _CallHung(Exception):
    pass


# Producers whose transactional call never returned. Referenced forever: destroying one would
# block on the same stuck call. At MAX_ABANDONED_PRODUCERS the worker stops with an error.
_ABANDONED_PRODUCERS: list = []
MAX_ABANDONED_PRODUCERS = 3


def _bounded_call(fn, timeout_s: float):
    """``fn()`` on a helper thread; raise :class:`_CallHung` if it is still running after
    ``timeout_s`` (plus a little slack for the call's own timeout to fire first)."""
    outcome: list = []
    done = threading.Event()

    def call():
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # re-raised on the caller's thread
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=call, name="llmq-txn-call", daemon=True).start()
    if not done.wait(timeout_s + 2.0):
        raise _CallHung()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _trace(request: Request) -> dict[str, str]:
    return {"trace_id": request.trace_id} if request.trace_id else {}


def _answer(request: Request, status: Status, worker_id: str, **fields) -> Response:
    """A worker's response to ``request`` other than the hot COMPLETED one.

    Every outcome carries what the gateway decided, whether or not the model was called:
    ``served_priority`` is the band the request was handled in (the gateway's
    ``effective_priority``, else the requested one), so expirations and cancellations can
    be split by the band they waited in; ``degraded`` says the gateway swapped the model.
    """
    return Response.for_request(
        request, status, worker_id=worker_id, admitted_at=request.admitted_at,
        served_priority=request.effective_priority or request.priority,
        degraded=request.degraded_from is not None, metadata=_trace(request), **fields)


def _fmt(partitions) -> str:
    return ", ".join(f"{p.topic}[{p.partition}]" for p in partitions) or "nothing"
