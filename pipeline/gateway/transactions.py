"""``gateway.processing_guarantee = "exactly-once"``: a round's outputs and the offsets of the
requests behind them commit together, in one Kafka transaction per request partition.

At-least-once (:mod:`pipeline.gateway.outputs`), a gateway killed after its outputs left but
before Faust committed the offsets of their requests leaves the new owner to decide them again;
the decisions are in the ``seen`` table, so it sends the same outputs again: duplicates. Here
the outputs of a round's requests from partition ``p`` and the next offset of every topic
partition ``p`` they came from go into one transaction of the producer whose transactional id is
``{app_id}-eos-{p}``. A read_committed reader (workers on the dispatch topics, clients on the
responses) sees the outputs if and only if the offsets are committed: after a kill, the new
owner starts after what is committed and redoes only what was aborted, from the same decisions.

Why not Faust's own ``processing_guarantee="exactly_once"``: its ``TransactionManager.send``
(faust/transport/consumer.py) takes the transactional id ``{app_id}-{group}-{p}`` from the
partition ``p`` the record's key falls in *in the destination topic*, and ``commit`` groups the
offsets by the *source* partition's number the same way. That only pairs a record with the
offsets of its own request when source and destination are co-partitioned; the dispatch topics
have their own partition count (``topics.dispatch_partitions``), so a request of partition 2
could be dispatched in the transaction of partition 5, committed with the offsets of other
requests; a dispatch partition number this gateway holds no request partition of names no
producer at all (faust/transport/drivers/aiokafka.py, ``Producer.send``: "No transaction producer
found"), and every such send fails. And the gateway's outputs do not go through Faust's
producer at all (librdkafka's, or the producers here), while Faust's transactional producer
would also carry the changelog writes that must be durable *before* an output leaves (the
write-ahead decision log).

A record Faust hands over twice within one assignment is dropped (:class:`Redeliveries`), and
Faust's consumer reads read_committed (:func:`pipeline.gateway.faust_compat.set_read_committed`).

Which partition a round's work belongs to is the partition number of the event it came from:
the request topics, the responses and the receipts are co-partitioned and Faust's assignor
hands a partition number of all of them to one gateway, so one producer per assigned number
covers both agents. Started (``InitProducerId``: the previous owner's producer is fenced and
its open transaction aborted) when the partition is assigned; stopped when no longer assigned.

Faust still commits what the agents acknowledge, and a regular offset commit written to the
group after a transaction's offsets wins over them when that transaction completes. So the
transactions of a round hold Faust's commit (:func:`pipeline.gateway.faust_compat.commits_held`),
and a request is acknowledged only once its transaction is committed: whatever Faust commits is
then at or past what the transactions committed.

A transaction the broker refuses (fenced by a new owner, timed out) stops the gateway as an
undelivered output does at-least-once: the restart redoes from the committed offsets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from pipeline.gateway.outputs import Done, Output

log = logging.getLogger(__name__)


@dataclass
class PartitionWork:
    """What one request partition number has in a round: its outputs (each with its request's
    countdown) and, per source topic, the offset after its last event."""

    partition: int
    outputs: list[tuple[Done, Output]] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)


def group_round(dones: Iterable[Done], outputs: Iterable[tuple[Done, list[Output]]]) -> dict[int, PartitionWork]:
    """A round's work by partition number: every event's next offset (events without outputs
    too: their offsets commit with the others of their partition), every output under its
    event's partition. Events come in offset order per topic partition and a round takes all of
    them decided since the last one, so the highest offset + 1 covers everything before it."""
    work: dict[int, PartitionWork] = {}
    for done in dones:
        msg = _message(done)
        if msg is None:
            continue
        part = work.get(msg.partition)
        if part is None:
            part = work[msg.partition] = PartitionWork(msg.partition)
        if msg.offset + 1 > part.offsets.get(msg.topic, -1):
            part.offsets[msg.topic] = msg.offset + 1
    for done, outs in outputs:
        msg = _message(done)
        if msg is None:
            raise ValueError("an output without the event it came from has no transaction to go in")
        part = work.get(msg.partition)
        if part is None:  # its done not listed: still its offset, so that the output is not orphaned
            part = work[msg.partition] = PartitionWork(msg.partition)
            part.offsets[msg.topic] = msg.offset + 1
        part.outputs.extend((done, out) for out in outs)
    return work


def _message(done: Done):
    return getattr(done.event, "message", None)


class TransactionFailed(Exception):
    pass


class Superseded(Exception):
    """A round's transaction fenced by a newer producer of its partition: the partition moved
    (or a rebalance is under way) while the round ran. That producer's start aborted this
    transaction, and the partition's owner redoes the work from the committed offsets: nothing
    of it is acknowledged here, and the gateway goes on."""


class Redeliveries:
    """Records Faust delivers again within one assignment, dropped before they are decided.

    After a rebalance Faust can hand a record over twice (what it fetched before its seek to
    the committed offsets, then the same offsets again). At-least-once the second copy is a
    repeat it allows; here its outputs would be a second committed copy, and its offset, put
    in a transaction after a later one's, would take the group back. A record at or below the
    last one handled in this assignment has been decided by this gateway already: its outputs
    are committed, or on their way in a round that stops the gateway if it fails.
    """

    def __init__(self):
        self._next: dict[tuple[str, int], int] = {}
        self.dropped = 0

    def assigned(self) -> None:
        self._next.clear()

    def fresh(self, topic: str, partition: int, offset: int) -> bool:
        key = (topic, partition)
        if offset < self._next.get(key, -1):
            self.dropped += 1
            if self.dropped == 1 or not self.dropped % 1000:
                log.info("%s[%d]@%d delivered again in this assignment: dropped (%d so far)", topic, partition,
                         offset, self.dropped)
            return False
        self._next[key] = offset + 1
        return True


class Transactions:
    """One transactional aiokafka producer per assigned request partition number."""

    def __init__(self, app_id: str, client_config: dict[str, Any], on_failure: Callable[[str], None], *,
                 group_id: str | None = None, hold_commits=None, transaction_timeout_ms: int = 60_000,
                 read_floor: Callable[[int], dict[str, int]] | None = None):
        """``read_floor(p)``: the group's committed offsets of partition number ``p``, per source
        topic (blocking; read once ``p``'s producer has started)."""
        self.app_id = app_id
        self.group_id = group_id or app_id  # Faust's consumer group is its app id
        self.client_config = client_config
        self.on_failure = on_failure
        #: An async context manager factory that keeps Faust from committing meanwhile.
        self.hold_commits = hold_commits
        self.transaction_timeout_ms = transaction_timeout_ms
        self._producers: dict[int, Any] = {}
        self._assigned: set[int] = set()
        #: Partitions whose producer another gateway's fenced: their work waits for the next
        #: assignment (the group is moving them), and is redone by whoever gets them.
        self._fenced: set[int] = set()
        # Being started: initialising can wait for the previous owner's open transaction to be
        # aborted, and Faust may hand over the partition's records meanwhile.
        self._starting: dict[int, asyncio.Task] = {}
        self.committed = 0  # transactions committed (for tests and logs)
        #: Partition number → when its open transaction began (monotonic): the progress watch's.
        self.open_since: dict[int, float] = {}
        self.failed: list[str] = []
        # The previous owner's last transaction may have been committing when this gateway read
        # the group's offsets at assignment (aiokafka's offset fetch cannot ask for stable
        # offsets, KIP-447): its offsets were not the group's yet, so Faust starts before them.
        # Once this partition's producer has started, that transaction is over (InitProducerId
        # waits for it), and the offsets read then are the floor: an event below it was decided,
        # sent and committed by the previous owner, and is neither decided nor sent again here.
        self.read_floor = read_floor
        self.floors: dict[int, dict[str, int]] = {}
        self.below_floor = 0  # events dropped so (for tests and logs)
        # The same holds for a partition kept across a rebalance: Faust seeks it back to the
        # committed offsets while this gateway's own round may still be committing past them.
        # So after every assignment each partition's floor is read again (a new one's once its
        # producer started, a kept one's once the round running at the rebalance has ended), and
        # a later round's transaction of that partition waits for it (:meth:`settled`).
        self._floor_tasks: dict[int, asyncio.Future] = {}
        self._floor_after: dict[int, asyncio.Future | None] = {}  # the round a kept partition's floor waits for
        self._round: asyncio.Future | None = None  # the round committing now

    def transactional_id(self, partition: int) -> str:
        return f"{self.app_id}-eos-{partition}"

    async def assigned(self, partitions: set[int]) -> None:
        """Stop the producers of partitions no longer assigned, start (and so fence the previous
        owner's) those of the new ones. Kept across a rebalance that leaves a partition here.

        The new ones start in the background: this runs inside Faust's rebalance, and starting
        waits for the transaction coordinator (seconds while a broker is down, and the previous
        owner's open transaction is aborted first). Awaited here, the wait outlasted the group
        session, the gateway was expelled, and every member rejoined again. A round waits for
        its partition's producer instead."""
        self._assigned = set(partitions)
        self._fenced -= self._assigned  # assigned (again): a new producer starts below
        new = sorted(p for p in partitions if p not in self._producers and p not in self._starting)
        for p in new:  # before any await: a round from now on waits for them
            self._starting[p] = self._floor_tasks[p] = asyncio.ensure_future(self._start(p))
            self._floor_after[p] = None
        if self.read_floor is not None:
            for p in sorted(set(partitions) - set(new)):
                self._floor_tasks[p] = asyncio.ensure_future(self._refresh_floor(p, self._round))
                self._floor_after[p] = self._round
        gone = [p for p in (*self._producers, *self._starting) if p not in partitions]
        for p in gone:
            asyncio.ensure_future(self._stop(p))

    async def _producer(self, partition: int):
        starting = self._starting.get(partition)
        if starting is not None:
            producer = await starting
            if self._starting.get(partition) is starting:
                del self._starting[partition]
                self._producers[partition] = producer
            return producer
        return self._producers.get(partition)

    async def _start(self, partition: int, retry_s: float = 1.0):
        """A started producer for ``partition``; tried again while the cluster cannot answer (a
        broker down, the coordinator moving), for as long as the partition stays assigned."""
        from aiokafka import AIOKafkaProducer
        from aiokafka.errors import KafkaError

        while True:
            producer = AIOKafkaProducer(**self.client_config, transactional_id=self.transactional_id(partition),
                                        enable_idempotence=True, acks="all",
                                        transaction_timeout_ms=self.transaction_timeout_ms,
                                        # Every round waits for its own records: lingering only delays it.
                                        linger_ms=0)
            try:
                await producer.start()
                log.info("transactional producer started for partition %d", partition)
                await self._read_floor(partition)
                return producer
            except KafkaError as exc:
                log.warning("transactional producer of partition %d not started (%r); retrying", partition, exc)
                try:
                    await producer.stop()
                except Exception:  # noqa: BLE001 (half started: nothing to keep)
                    pass
                await asyncio.sleep(retry_s)

    def settled(self, partition: int) -> asyncio.Future | None:
        """The floor of ``partition`` being read again after the last assignment, or None."""
        task = self._floor_tasks.get(partition)
        return None if task is None or task.done() else task

    async def _refresh_floor(self, partition: int, running: asyncio.Future | None) -> None:
        if running is not None:
            await asyncio.wait([running])
        await self._read_floor(partition)

    async def _read_floor(self, partition: int) -> None:
        if self.read_floor is None:
            return
        try:
            self.floors[partition] = await asyncio.to_thread(self.read_floor, partition)
        except Exception as exc:  # noqa: BLE001 (KafkaException: without a floor, as before)
            log.warning("could not read the committed offsets of partition %d (%s): events the previous owner "
                        "committed may be sent again", partition, exc)

    def fresh(self, topic: str, partition: int, offset: int) -> bool:
        """Whether an event is not below its partition's floor (committed by the previous owner)."""
        floor = self.floors.get(partition)
        if floor is None or offset >= floor.get(topic, -1):
            return True
        self.below_floor += 1
        if self.below_floor == 1 or not self.below_floor % 1000:
            log.info("%s[%d]@%d was committed by this partition's previous owner: dropped (%d so far)", topic,
                     partition, offset, self.below_floor)
        return False

    async def _stop(self, partition: int) -> None:
        self.floors.pop(partition, None)
        self._floor_after.pop(partition, None)
        floor_task = self._floor_tasks.pop(partition, None)
        if floor_task is not None and not floor_task.done() and floor_task is not self._starting.get(partition):
            floor_task.cancel()
        starting = self._starting.pop(partition, None)
        producer = self._producers.pop(partition, None)
        if starting is not None and (not starting.done() or starting.cancelled()):
            starting.cancel()  # still trying to start: the partition's new owner fences it anyway
            return
        try:
            if starting is not None:
                producer = starting.result()
            if producer is not None:
                await producer.stop()
        except Exception as exc:  # noqa: BLE001 (fenced by the new owner: nothing of ours is open)
            log.info("transactional producer of partition %d stopped: %r", partition, exc)

    async def close(self) -> None:
        await asyncio.gather(*(self._stop(p) for p in {*self._producers, *self._starting}))

    async def commit(self, dones: list[Done], outputs: list[tuple[Done, list[Output]]]) -> set[int] | None:
        """Commit the round's outputs with their offsets, one transaction per partition number
        with outputs (in parallel: each has its producer). Partitions whose events had no output
        need none: Faust commits them once they are acknowledged. Returns the partitions whose
        transactions were superseded (their events must not be acknowledged), or None: a
        transaction failed, the gateway is stopping, and nothing of this round may be acknowledged."""
        work = [w for w in group_round(dones, outputs).values() if w.outputs]
        if not work:
            return set()
        self._round = asyncio.get_running_loop().create_future()
        try:
            if self.hold_commits is None:
                results = await self._all(work)
            else:
                async with self.hold_commits():
                    results = await self._all(work)
        finally:
            self._round.set_result(None)
            self._round = None
        superseded = [r for r in results if isinstance(r, Superseded)]
        if superseded:
            log.info("%d transactions of this round fenced by a newer producer of their partition (it moved); "
                     "its owner redoes them", len(superseded))
        failures = [r for r in results if isinstance(r, BaseException) and not isinstance(r, Superseded)]
        if failures:
            exc = failures[0]
            what = f"transaction refused ({type(exc).__name__}: {exc})"
            self.failed.append(what)
            self.on_failure(what)
            return None
        self.committed += len(work) - len(superseded)
        return {exc.args[0] for exc in superseded}

    async def _all(self, work: list[PartitionWork]) -> list:
        # Every transaction ends before Faust may commit again, the failed ones' neighbours too.
        return await asyncio.gather(*(self._transaction(w) for w in work), return_exceptions=True)

    async def _transaction(self, work: PartitionWork) -> None:
        from aiokafka.structs import TopicPartition

        producer = await self._producer(work.partition)
        if producer is None and work.partition in self._fenced:
            raise Superseded(work.partition)
        if producer is None:
            raise TransactionFailed(f"partition {work.partition} is not assigned to this gateway")
        refresh = self.settled(work.partition)
        if refresh is not None and self._floor_after.get(work.partition) is not self._round:
            await asyncio.wait([refresh])  # a floor read after an earlier round: this round's events are newer
        work = self._above_floor(work)
        if not work.outputs:
            return  # all committed by the previous owner already
        await producer.begin_transaction()
        self.open_since[work.partition] = time.monotonic()
        try:
            sent = []
            for _, out in work.outputs:
                sent.append(await producer.send(out.topic, out.value, key=out.key, partition=out.partition,
                                                headers=out.headers))
            # A record the broker refuses fails its own future: it must fail the transaction too,
            # not leave it committed without that record.
            await asyncio.gather(*sent)
            await producer.send_offsets_to_transaction(
                {TopicPartition(topic, work.partition): offset for topic, offset in work.offsets.items()},
                self.group_id)
            await producer.commit_transaction()
        except BaseException as exc:
            try:
                await producer.abort_transaction()
            except Exception:  # noqa: BLE001 (fenced or broken: the broker aborts it on the next init)
                pass
            if _fenced(exc):
                # Another gateway's producer for this partition started: the partition moved, or a
                # rebalance is under way and this gateway's view of it is stale. Either way this
                # producer is done for, and the partition's owner redoes the work from the
                # committed offsets; if the next assignment gives the partition here, a new
                # producer starts then. (Starting one at once would fence the other gateway back,
                # each waiting on the other's transactions.)
                if self._producers.get(work.partition) is producer:
                    del self._producers[work.partition]
                    self._fenced.add(work.partition)
                    asyncio.ensure_future(_quiet_stop(producer))
                raise Superseded(work.partition) from exc
            raise
        finally:
            self.open_since.pop(work.partition, None)


    def _above_floor(self, work: PartitionWork) -> PartitionWork:
        """``work`` without the events decided before the floor was known that the previous owner
        had committed (their outputs are out already), nor offsets that would take the group back."""
        floor = self.floors.get(work.partition)
        if not floor:
            return work
        outputs = []
        for done, out in work.outputs:
            msg = _message(done)
            if msg is None or self.fresh(msg.topic, msg.partition, msg.offset):
                outputs.append((done, out))
        if len(outputs) == len(work.outputs):
            return work
        offsets = {topic: offset for topic, offset in work.offsets.items() if offset > floor.get(topic, -1)}
        return PartitionWork(work.partition, outputs, offsets)


def _fenced(exc: BaseException) -> bool:
    from aiokafka.errors import ProducerFenced

    return isinstance(exc, ProducerFenced)


async def _quiet_stop(producer) -> None:
    try:
        await producer.stop()
    except Exception:  # noqa: BLE001 (fenced: nothing of ours is open)
        pass
