"""The worker loop: consume requests, call the backend, publish responses, commit behind them.

One asyncio thread owns the consumer and the producer, so rebalance callbacks, delivery
callbacks and commits never race. The loop never blocks on the backend: calls run as
tasks (up to ``max_inflight``), and the loop keeps calling ``consume`` — with the
partitions paused when the worker is full — so a long LLM call never makes the group
evict the worker for missing ``max.poll.interval.ms``.

Each turn: consume, take (queue by band), dispatch (start what the scheduler picks, a chunk
at a time), pause or resume partitions, serve delivery reports, commit when due. The parts
are made once, in context.py; the processor (processor.py) runs a chunk of requests through
decode, checks, the backend and their answers. ``take``, ``dispatch`` and ``handle`` are the
loop's steps, public so that tools, benchmarks and tests drive a worker without a broker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from typing import Callable

from confluent_kafka import Consumer, KafkaError, Producer

from pipeline.cancellations import CancellationView
from pipeline.config import Settings
from pipeline.dlq import MAX_DEAD_LETTER_BYTES
from pipeline.errors import ConfigError, KafkaOperationError
from pipeline.observability.metrics import TenantLabels, WorkerMetrics
from pipeline.serde import Codec
from pipeline.serde.factory import codec_for
from pipeline.worker.announcer import Announcer
from pipeline.worker.backends.base import Backend
from pipeline.worker.context import WorkerContext
from pipeline.worker.coordinator_watch import CoordinatorWatch
from pipeline.worker.membership import apply_group_session
from pipeline.worker.processor import Processor
from pipeline.worker.state import WorkerStats

__all__ = ["Worker", "WorkerStats"]

log = logging.getLogger(__name__)

_PARTITION_EOF = KafkaError._PARTITION_EOF

# Requests processed stage by stage at a time (fewer if fewer backend slots are free).
_DISPATCH_CHUNK = 64

# After a freeze longer than the session timeout, how long a worker starts no new work: enough
# for librdkafka to notice the expired session and report the lost partitions.
_FROZEN_HOLD_S = 4.0

# How often the per-tenant fair-share metrics close a tick.
FAIRNESS_TICK_S = 1.0


class Worker:
    def __init__(self, settings: Settings, backend: Backend, *, topics: list[str] | None = None,
                 codec: Codec | None = None, worker_id: str | None = None,
                 consumer_overrides: dict | None = None, producer_overrides: dict | None = None,
                 metrics: WorkerMetrics | None = None, weights: Callable[[str], float] | None = None):
        """``weights(tenant)``: its share of a band against other tenants (the tenant registry's
        ``weight``; ``worker.tenant_weights`` win over it; default 1 each)."""
        self.settings = settings
        self.cfg = cfg = settings.worker
        self.topics = topics or settings.topics.pool_topics(cfg.pool, cfg.source)
        self.group_id = cfg.effective_group_id()
        self.codec = codec or codec_for(settings.serde)
        if cfg.static_membership and not (worker_id or cfg.worker_id):
            raise ConfigError("worker.worker_id", "static_membership needs a worker id that survives restarts "
                                                  "(a pod name); the default <hostname>-<pid> changes every time")
        self.worker_id = worker_id or cfg.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.responses_topic = settings.topics.responses
        self.dlq_topic = settings.topics.dlq
        metrics = metrics or WorkerMetrics(pool=cfg.pool,
                                           tenants=TenantLabels(cfg.metrics_tenants, cfg.metrics_tenant_top_n))
        self.ctx = ctx = WorkerContext.build(settings, topics=self.topics, codec=self.codec, worker_id=self.worker_id,
                                             metrics=metrics, weights=weights)
        self.stats, self.metrics, self.session = ctx.stats, ctx.metrics, ctx.session
        self.scheduler, self.flow, self.checkpoint = ctx.scheduler, ctx.flow, ctx.checkpoint
        self.recent, self.responder, self.chunks = ctx.recent, ctx.responder, ctx.chunks
        self.processor = Processor(ctx, backend)
        self._consumer_overrides = consumer_overrides or {}
        self._producer_overrides = producer_overrides or {}
        #: The consumer's group coordinator, from its statistics; replaced with each session.
        self.coordinator = CoordinatorWatch(self.cfg.coordinator_stall_ms / 1000.0)
        self._stop = threading.Event()
        self._backend_full = False  # the last dispatch stopped because the backend had no room
        #: For /healthz and /readyz (pipeline/worker/health.py), read from the metrics server's
        #: thread: when the consume loop last turned, and the partitions assigned now.
        self.turned_at: float | None = None
        self.assigned: frozenset[tuple[str, int]] = frozenset()

    @property
    def consumer(self) -> Consumer | None:
        """The session's consumer (None between sessions)."""
        return self.session.consumer

    @property
    def producer(self) -> Producer | None:
        """The session's producer (None between sessions, or once abandoned)."""
        return self.session.producer

    @property
    def backend(self) -> Backend:
        return self.processor.backend

    @property
    def running(self) -> dict:
        """The backend calls running now: ``(tp, offset)`` → their task."""
        return self.processor.tasks

    @property
    def exactly_once(self) -> bool:
        return self.checkpoint.exactly_once

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
        if self.session.fatal is not None:
            raise self.session.fatal
        return self.stats

    async def _main(self) -> None:
        if self.cfg.group_protocol == "consumer":
            apply_group_session(self.settings, self.group_id)
        announcer = Announcer(self.settings, self.backend, self.group_id)
        await announcer.read()  # the servers' lists first: a request naming no model needs the default
        announcing = asyncio.create_task(announcer.run(), name="llmq-models")
        try:
            await self._sessions()
        finally:
            announcing.cancel()

    async def _sessions(self) -> None:
        while True:
            await self._session()
            session = self.session
            if not session.restart or self._stop.is_set() or session.fatal is not None:
                return
            # A transaction was aborted or the producer fenced: start over from the committed
            # offsets with fresh clients (the consumer does not rewind by itself).
            log.warning("restarting from the last committed offsets")
            self._reset()

    def _reset(self) -> None:
        self.ctx.reset()
        self.processor.reset()

    async def _session(self) -> None:
        cfg, session = self.cfg, self.session
        producer_conf = {"client.id": f"llmq-worker-{self.worker_id}",
                         # room for a dead letter of the largest request the broker accepts, plus headers
                         "message.max.bytes": MAX_DEAD_LETTER_BYTES + 65536,
                         "linger.ms": cfg.producer_linger_ms}
        consumer_conf = {"client.id": f"llmq-worker-{self.worker_id}",
                         "max.poll.interval.ms": cfg.max_poll_interval_ms,
                         **cfg.membership_config(self.worker_id)}
        self.coordinator = CoordinatorWatch(cfg.coordinator_stall_ms / 1000.0)
        if cfg.coordinator_stall_ms:
            consumer_conf.update({"statistics.interval.ms": self.coordinator.interval_ms(),
                                  "stats_cb": self.coordinator.observe})
        self.checkpoint.configure(producer_conf, consumer_conf, f"llmq-worker-{self.group_id}-{self.worker_id}")
        session.producer = Producer(self.settings.kafka.producer_config(**producer_conf, **self._producer_overrides))
        self.checkpoint.start(session.producer)
        session.cancellations = CancellationView(self.settings)
        # Every cancellation written so far is known before a request is taken: the previous
        # owner of a partition may have answered one of its requests CANCELLED, and running it
        # here would give it a second status. Before subscribing, so that a slow read cannot
        # count against max.poll.interval.ms.
        session.cancellations.catch_up()
        session.consumer = Consumer(self.settings.kafka.consumer_config(
            self.group_id, **consumer_conf, **self._consumer_overrides))
        session.consumer.subscribe(self.topics, on_assign=self.on_assign, on_revoke=self.on_revoke,
                                   on_lost=self.on_lost)
        log.info("worker %s consuming %s as group %s (backend %s, max in flight %d)",
                 self.worker_id, ", ".join(self.topics), self.group_id, self.backend.name, cfg.max_inflight)
        up = self.metrics.up.labels(self.metrics.pool)
        up.set(1)
        try:
            await self._consume_until_stopped()
            if not session.restart:
                await self._drain(cfg.shutdown_grace_s)
            else:
                await self.processor.stop_all()
        finally:
            up.set(0)
            self._close()
            await self.backend.close()

    async def _consume_until_stopped(self) -> None:
        session, cfg = self.session, self.cfg
        consumer, producer = session.consumer, session.producer
        flow, checkpoint, processor, chunks = self.flow, self.checkpoint, self.processor, self.chunks
        tasks = processor.tasks
        idle_s = cfg.idle_poll_ms / 1000.0
        batch = cfg.batch_size
        take, dispatch = self.take_many, self.dispatch
        session_s = cfg.session_timeout_ms / 1000.0
        last_turn = time.monotonic()
        hold_until = 0.0
        next_fairness_tick = last_turn + FAIRNESS_TICK_S
        wait_in_poll = False  # idle with nothing in flight: the next poll waits for a message itself
        while not self._stop.is_set() and not session.over:
            now = time.monotonic()
            if now - last_turn > session_s:
                # Frozen (SIGSTOP, a VM pause, a long GC) past the session timeout: the group
                # has most likely given our partitions away. Start nothing new until librdkafka
                # has told us (on_lost / on_revoke drop that work); a zombie answering its
                # whole backlog would only make duplicates.
                log.warning("this worker stood still for %.1f s, longer than session.timeout.ms; holding new work "
                            "for %.0f s until the group says which partitions are still ours",
                            now - last_turn, _FROZEN_HOLD_S)
                hold_until = session.held_until = now + _FROZEN_HOLD_S
            last_turn = self.turned_at = session.turned_at = now
            stalled = self.coordinator.stalled_for()
            if stalled is not None:
                log.error("the group coordinator has not been reachable for %.0f s (%s) although the consumer "
                          "keeps trying; starting a new session with new clients from the committed offsets",
                          stalled, self.coordinator.what)
                session.restart = True
                break
            # Always poll: it serves rebalances and keeps max.poll.interval.ms satisfied, even
            # while every backend slot is busy (full partitions are paused, so nothing piles up).
            msgs = consumer.consume(batch, 0)
            if not msgs and wait_in_poll:
                # librdkafka wakes this as soon as a message arrives, where a sleep of idle_s
                # would add up to idle_s to its wait (about half of it on average). Blocking the
                # event loop costs nothing here: no backend call is in flight.
                msgs = consumer.consume(1, idle_s)
                if msgs and batch > 1:
                    msgs += consumer.consume(batch - 1, 0)
            wait_in_poll = False
            flow.reapply_if_reassigned()
            if msgs:
                take(msgs)
            for request_id in session.cancellations.poll():
                processor.cancel(request_id)
            dispatched = dispatch() if now >= hold_until else 0
            flow.turn()
            producer.poll(0)
            chunks.poll()
            if checkpoint.due(now):
                checkpoint.commit(asynchronous=True)
            if now >= next_fairness_tick:
                next_fairness_tick = now + FAIRNESS_TICK_S
                self.fairness_tick()
            if flow.full(len(tasks)) or self._backend_full:
                # Woken as soon as a call ends (a slot is free), or a little later (a server's
                # metrics may have said it has more room).
                await flow.wait_for_slot(idle_s)
            elif not msgs and not dispatched:
                if tasks:
                    await asyncio.sleep(idle_s)
                else:
                    wait_in_poll = True
                    await asyncio.sleep(0)
            elif tasks:
                await asyncio.sleep(0)

    # -- taking and dispatching -----------------------------------------------------------

    def take_many(self, msgs: list) -> None:
        """:meth:`take` each of ``msgs`` (one consume's worth), the common case inline."""
        started, add, skipping = self.checkpoint.tracker.started, self.scheduler.add, self.checkpoint.done_before
        decode = self.processor.decode
        for msg in msgs:
            if msg.error() is not None or skipping:
                self.take(msg)  # errors, and the first messages after a rebalance: the whole story
                continue
            tp = (msg.topic(), msg.partition())
            started(tp, msg.offset())
            request = decode(msg)
            if request is not None:
                add(tp, msg, request)

    def take(self, msg) -> None:
        """Accept a consumed message: decoded into its band's queue, or dead-lettered if it cannot
        be (its offset now holds commits back until it is answered)."""
        err = msg.error()
        if err is not None:
            if err.code() != _PARTITION_EOF:
                log.warning("consumer error: %s", err)
                if err.fatal():
                    self.session.fail(KafkaOperationError("consume", err.str(), err))
            return
        tp = (msg.topic(), msg.partition())
        if self.checkpoint.take(tp, msg.offset()):
            request = self.processor.decode(msg)
            if request is not None:
                self.scheduler.add(tp, msg, request)

    def dispatch(self) -> int:
        """Start queued requests, highest band first (minimum shares aside), while slots are free.

        A slot is free while fewer than ``max_inflight`` calls run and, for a backend that paces
        its servers, while a server can start one more now (``room``): what the servers cannot
        start yet waits here, in band order, rather than in their own first-come queues. A
        request whose model's servers are full (others have room) goes back to its queue.

        Requests are picked a chunk at a time, at most as many as there are free slots (each
        takes at most one), and the chunk is processed stage by stage. Returns how many started
        (a preempted call wakes the loop when it ends, for the request it makes way for).
        """
        tasks, cfg, scheduler, processor = self.processor.tasks, self.cfg, self.scheduler, self.processor
        backend_room = processor.room
        n = 0
        self._backend_full = False
        processor.held_model = None
        backs: set[int] = set()  # put back in this dispatch: picked again, they go back again
        while True:
            room = cfg.max_inflight - len(tasks)
            if room > 0 and backend_room is not None:
                free = backend_room()
                if free < room:
                    room = free
                    self._backend_full = free <= 0
            if room <= 0:
                # A preempted call gives its server slot back once its cancellation has run (the
                # next turn): until then nothing can start, and the request it made way for
                # cancels no second call. Taking requests meanwhile only put them back, up to
                # a chunk's worth each turn.
                if processor.releasing:
                    break
                if scheduler.may_preempt and processor.preempt():
                    continue
                break
            # Room for as many more as went back already: requests of other models behind them
            # may start (never more than ``room``: process() puts back the rest).
            chunk = scheduler.next_chunk(min(room, _DISPATCH_CHUNK) + len(backs))
            if not chunk:
                break
            put_back = processor.process(chunk, room)
            scheduler.chunk_done()
            n += len(chunk) - put_back
            if put_back:
                self._backend_full = True
                fresh = [m for m in processor.put_back if id(m) not in backs]
                backs.update(id(m) for m in fresh)
                if (len(chunk) == put_back and not fresh) or len(backs) >= _DISPATCH_CHUNK:
                    break
        if backs and scheduler.may_preempt and not processor.releasing:
            # A waiting request's servers are full: a call of a lower band there may make way.
            processor.preempt(processor.held_model)
        return n

    def fairness_tick(self) -> None:
        """Close a tick of the fair-share metrics: who waits now in each band, with their weights."""
        weight = self.scheduler.weight_of
        self.metrics.fairness_tick([{t: weight(t) for t in q.waiting_tenants()} for q in self.scheduler.queues])

    def handle(self, msg) -> None:
        """Take one message and process it at once (no band scheduling): tests and tools."""
        depth = self.scheduler.depth((msg.topic(), msg.partition())) if msg.error() is None else 0
        self.take(msg)
        if msg.error() is None and self.scheduler.depth((msg.topic(), msg.partition())) > depth:
            entry = self.scheduler.take_back((msg.topic(), msg.partition()))
            self.processor.process([entry])

    # -- rebalances -----------------------------------------------------------------------

    def on_assign(self, consumer, partitions) -> None:
        self.stats.rebalances += 1
        self.metrics.rebalances.labels(self.metrics.pool).inc()
        self.flow.assignment_changed = True
        log.info("assigned %s", _fmt(partitions))
        self.assigned = self.assigned | {(p.topic, p.partition) for p in partitions}
        self.processor.read_back.assigned((p.topic, p.partition) for p in partitions)
        self.checkpoint.assigned(consumer, partitions)

    def on_revoke(self, consumer, partitions) -> None:
        self.stats.rebalances += 1
        self.metrics.rebalances.labels(self.metrics.pool).inc()
        self.flow.assignment_changed = True
        revoked = {(p.topic, p.partition) for p in partitions}
        log.info("revoked %s", _fmt(partitions))
        self.assigned = self.assigned - revoked
        self._give_up(revoked)
        self.recent.forget_answers(self.checkpoint.revoked(revoked))

    def on_lost(self, consumer, partitions) -> None:
        # Lost, not revoked: another member may already own them, so committing is pointless.
        self.flow.assignment_changed = True
        log.warning("lost %s (session timed out?)", _fmt(partitions))
        lost = {(p.topic, p.partition) for p in partitions}
        self.assigned = self.assigned - lost
        self._give_up(lost)
        self.recent.forget_answers(self.checkpoint.lost(lost))

    def _give_up(self, partitions: set) -> None:
        """Hand back the work of ``partitions``, running or queued: its offsets stay uncommitted,
        so their next owner runs it. Redelivered here, it is not a copy of itself; answered
        already, it is given the same answer again (see dedupe.py)."""
        self.processor.hand_back(partitions)
        self.scheduler.drop(partitions)
        self.flow.forget(partitions)
        self.recent.release(partitions)

    # -- the end --------------------------------------------------------------------------

    async def _drain(self, grace_s: float) -> None:
        """Stop fetching, let in-flight calls finish within the grace period, hand back the rest."""
        session = self.session
        if session.consumer is None:
            return
        self.flow.pause_all()
        deadline = time.monotonic() + grace_s
        tasks = self.processor.tasks
        if tasks:
            log.info("draining %d in-flight requests (grace %.1fs)", len(tasks), grace_s)
        while tasks and time.monotonic() < deadline and session.fatal is None:
            session.consumer.consume(1, 0)  # keeps group membership alive; partitions are paused
            session.producer.poll(0)
            await asyncio.sleep(0.01)
        if tasks:
            log.info("handing back %d unfinished requests", len(tasks))
        await self.processor.stop_all()
        remaining = session.producer.flush(30)
        if remaining:
            log.error("%d responses still unacknowledged at shutdown; their requests will be redelivered", remaining)

    def _close(self) -> None:
        session = self.session
        if session.consumer is not None:
            if not session.over:
                self.checkpoint.commit(asynchronous=False)
            try:
                session.consumer.close()  # leaves the group now instead of after session timeout
            except Exception as exc:  # noqa: BLE001 (raised by a rebalance callback inside close(): the
                # revocation's flush of a producer in a fatal state, say; the next session starts clean)
                log.warning("closing consumer: %s", exc)
            session.consumer = None
        if session.producer is not None:
            session.producer.flush(10)
            session.producer = None
        self.chunks.close()
        self.ctx.earlier.close()
        if session.cancellations is not None:
            session.cancellations.close()
            session.cancellations = None
        log.info("worker %s stopped: %s", self.worker_id, self.stats)


def _fmt(partitions) -> str:
    return ", ".join(f"{p.topic}[{p.partition}]" for p in partitions) or "nothing"
