"""Commits: how far each partition is done, and saying so to the broker.

At-least-once: a request's offset becomes committable only when the broker has acknowledged
its response (or its dead letter), and a partition commits only up to its contiguous finished
prefix (:class:`~pipeline.worker.offsets.OffsetTracker`). A crash therefore re-runs, never
loses, requests. Each commit also lists, in its metadata, the offsets finished past its
position, so the partition's next owner skips them instead of answering them twice.

Exactly-once: outcomes wait here until their partition's contiguous prefix reaches them, then
go out in one transaction with the offsets that cover them. A failed transaction is aborted
and the session starts over from the committed offsets (after ``abort_transaction()`` the
consumer does not rewind by itself). Transactional calls run under a watchdog, since
librdkafka can block in them for ever; a producer stuck in one is abandoned.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from pipeline.config import WorkerSettings
from pipeline.errors import KafkaOperationError
from pipeline.observability.metrics import WorkerMetrics
from pipeline.worker.offsets import OffsetTracker, decode_done
from pipeline.worker.records import Outcome, rd_partition
from pipeline.worker.state import Session, WorkerStats

log = logging.getLogger(__name__)

# Producers whose transactional call never returned. Referenced forever: destroying one would
# block on the same stuck call. At MAX_ABANDONED_PRODUCERS the worker stops with an error.
_ABANDONED_PRODUCERS: list = []
MAX_ABANDONED_PRODUCERS = 3



class CallHung(Exception):
    pass


def bounded_call(fn, timeout_s: float):
    """``fn()`` on a helper thread; raise :class:`CallHung` if it is still running after
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
        raise CallHung()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


class OffsetCheckpoint:
    def __init__(self, cfg: WorkerSettings, session: Session, stats: WorkerStats, metrics: WorkerMetrics,
                 publish: Callable[..., None]):
        """``publish(topic, value, key, headers, None, partition)``: the careful produce (a full
        queue, a message too large), for a transaction's outcomes that the plain produce refused."""
        self.cfg = cfg
        self.session = session
        self.stats = stats
        self.metrics = metrics
        self._publish = publish
        self.exactly_once = cfg.delivery == "exactly-once"
        self.tracker = OffsetTracker()
        #: Exactly-once: per partition, offset → the outcome that waits for its transaction.
        self.ready: dict[tuple, dict[int, tuple[Outcome, ...]]] = {}
        #: At-least-once: offsets the previous owner answered past its commit position, per partition.
        self.done_before: dict[tuple, set[int]] = {}
        self.last_commit = time.monotonic()
        # A transactional call may block the poll loop this long: well inside max.poll.interval.ms,
        # so a slow commit (broker restarting) never evicts the worker from its group.
        self.txn_call_budget_s = min(30.0, max(1.0, cfg.max_poll_interval_ms / 1000 / 3))

    def reset(self) -> None:
        """Nothing is taken any more: the next session starts from the committed offsets."""
        self.tracker = OffsetTracker()
        self.ready.clear()
        self.done_before.clear()

    def configure(self, producer_conf: dict, consumer_conf: dict, transactional_id: str) -> None:
        """The clients' properties this delivery guarantee needs."""
        consumer_conf["on_commit"] = self.on_commit
        if self.exactly_once:
            # A stable id per worker: a restarted worker fences its predecessor and aborts its
            # open transaction at once instead of after transaction.timeout.ms.
            producer_conf.update({"transactional.id": transactional_id,
                                  "transaction.timeout.ms": self.cfg.transaction_timeout_ms})
            consumer_conf["isolation.level"] = "read_committed"

    def start(self, producer) -> None:
        if self.exactly_once:
            producer.init_transactions(30)

    # -- taking and finishing ----------------------------------------------------------------

    def take(self, tp: tuple, offset: int) -> bool:
        """A message was taken (its offset now holds commits back); False if it needs nothing
        more: its partition's previous owner answered it after its last commit position (its
        commit said so), so it is finished already, not a second time."""
        self.tracker.started(tp, offset)
        if self.done_before:
            done = self.done_before.get(tp)
            if done is not None and offset in done:
                done.discard(offset)
                if not done:
                    del self.done_before[tp]
                self.stats.skipped_done += 1
                self.tracker.finished(tp, offset)
                return False
        return True

    def finished(self, tp: tuple, offset: int) -> None:
        """The message's outcome is durable (at-least-once), or it needs none."""
        self.tracker.finished(tp, offset)

    def hold(self, tp: tuple, offset: int, outcome: Outcome, receipt: Outcome | None = None) -> None:
        """Exactly-once: ``outcome`` (and its completion ``receipt``, if it has one) goes out in
        the transaction that commits past ``offset``."""
        part = self.ready.get(tp)
        if part is None:
            part = self.ready[tp] = {}
        part[offset] = (outcome,) if receipt is None else (outcome, receipt)
        self.tracker.finished(tp, offset)

    # -- commits ----------------------------------------------------------------------------

    def due(self, now: float) -> bool:
        return now - self.last_commit >= self.cfg.commit_interval_ms / 1000.0

    def commit(self, asynchronous: bool, only: set | None = None) -> None:
        self.last_commit = time.monotonic()
        if self.exactly_once:
            self._commit_transaction()
            return
        positions = self.tracker.to_commit_with_done(only)
        if not positions:
            return
        offsets = [TopicPartition(t, p, pos, done) for (t, p), pos, done in positions]
        try:
            self.session.consumer.commit(offsets=offsets, asynchronous=asynchronous)
        except KafkaException as exc:
            # No assignment any more / rebalance in progress: the next owner starts from the
            # last successful commit, which only means redelivery.
            log.warning("commit failed (%s); those requests may be redelivered", exc.args[0])
            return
        self.tracker.mark_committed_with_done(positions)
        self.stats.commits += 1
        if not asynchronous:
            self.metrics.last_commit.labels(self.metrics.pool).set(time.time())

    def _commit_transaction(self) -> None:
        """One transaction: the outcomes covered by each partition's new position, and the positions."""
        session = self.session
        if session.restart or session.consumer is None:
            return
        positions = self.tracker.to_commit()
        if not positions:
            return
        producer = session.producer
        produced = 0
        offsets = [TopicPartition(t, p, pos) for (t, p), pos in positions]
        group_metadata = session.consumer.consumer_group_metadata()
        budget = self.txn_call_budget_s

        def send_offsets_and_commit():
            producer.send_offsets_to_transaction(offsets, group_metadata, budget)
            producer.commit_transaction(budget)

        try:
            producer.begin_transaction()
            produce = producer.produce
            for tp, position in positions:
                ready = self.ready.get(tp)
                if not ready:
                    continue
                for off in sorted(o for o in ready if o < position):
                    for topic, value, key, headers, partition in ready.pop(off):
                        try:
                            if headers is None:
                                produce(topic, value, key, partition=rd_partition(partition))
                            else:
                                produce(topic, value, key, partition=rd_partition(partition), headers=headers)
                        except (BufferError, KafkaException):  # queue full, or too large: the careful path
                            self._publish(topic, value, key, headers, None, partition)
                    produced += 1
            bounded_call(send_offsets_and_commit, budget)
        except CallHung:
            self.abandon_producer("the transaction commit")
            return
        except KafkaException as exc:
            err = exc.args[0]
            log.warning("transaction failed (%s); aborting and restarting from committed offsets", err)
            if not err.fatal():
                try:
                    bounded_call(lambda: producer.abort_transaction(budget), budget)
                except CallHung:
                    self.abandon_producer("the transaction abort")
                    return
                except KafkaException as abort_exc:
                    log.warning("abort failed too: %s", abort_exc)
            session.restart = True
            return
        self.tracker.mark_committed(positions)
        stats = self.stats
        stats.commits += 1
        stats.delivered += produced
        stats.last_delivered_at = time.perf_counter()
        self.metrics.last_commit.labels(self.metrics.pool).set(time.time())

    def abandon_producer(self, what: str) -> None:
        """A transactional call outlived its timeout: librdkafka can block forever in
        send_offsets_to_transaction while the group coordinator is unreachable (librdkafka
        #5456, #5511). Leave that producer to its stuck thread, never to be flushed or
        destroyed here, and restart: the next producer, with the same transactional.id,
        fences it, which aborts its open transaction on the broker."""
        log.error("%s did not return within %.0f s (broker unreachable?); abandoning the producer and "
                  "restarting from the committed offsets", what, self.txn_call_budget_s)
        session = self.session
        _ABANDONED_PRODUCERS.append(session.producer)
        session.producer = None
        session.restart = True
        if len(_ABANDONED_PRODUCERS) >= MAX_ABANDONED_PRODUCERS:
            # Each one keeps its threads, buffers and connections for the life of the process:
            # past a few, a clean restart by the supervisor costs less than running on.
            session.fail(KafkaOperationError(
                what, f"{len(_ABANDONED_PRODUCERS)} producers abandoned in stuck transactional calls; stopping "
                      "so that a restarted process frees them (nothing is lost: offsets stay uncommitted)"))

    def on_commit(self, err, partitions) -> None:
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

    # -- rebalances -------------------------------------------------------------------------

    def assigned(self, consumer, partitions) -> None:
        """At-least-once: read which offsets past each committed position were already answered
        (commit metadata)."""
        if self.exactly_once or not partitions:
            return
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
                self.done_before[key] = done
                skipped += len(done)
            else:
                self.done_before.pop(key, None)
        if skipped:
            log.info("%d requests past the committed offsets were answered before; skipping them", skipped)

    def revoked(self, partitions: set) -> set:
        """Publish and acknowledge what is finished of ``partitions``, commit it, then let them
        go. Returns the places ``(tp, offset)`` whose outcomes will never be published."""
        for tp in partitions:
            self.done_before.pop(tp, None)
        if self.session.producer is not None:  # None once abandoned: nothing can be committed then
            try:
                self.session.producer.flush(10)
            except Exception as exc:  # noqa: BLE001 (a producer in a fatal state: the session starts over)
                log.warning("flushing before a revocation failed: %s", exc)
        self.commit(asynchronous=False, only=partitions)
        return self.lost(partitions)

    def lost(self, partitions: set) -> set:
        """``partitions`` are gone (another member may own them already): forget them.

        Exactly-once outcomes past the committed position are not ours to publish any more:
        the next owner redoes them. Kept, they would go out if the partition came back, after
        the other owner had already answered them."""
        unpublished = set()
        for tp in partitions:
            self.tracker.forget(tp)
            self.done_before.pop(tp, None)
            ready = self.ready.pop(tp, None)
            if ready:
                unpublished.update((tp, offset) for offset in ready)
        return unpublished
