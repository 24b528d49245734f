"""The gateway's progress watch: a request or response partition whose reads have stopped.

Seen in `make chaos` on the three-node cluster: after a node was SIGKILLed, aiokafka's fetcher
logged "Failed fetch messages from 2: NodeNotReadyError" hundreds of times and then nothing, for
minutes, while the node was back and the group still heartbeated. The gateway kept its partitions
and decided nothing; no supervisor restarts a process that answers its probes. (aiokafka keeps one
fetch per node in flight and leaves every partition of a node out while another of its partitions
has records buffered; either can leave a partition unfetched with nothing that wakes it.)

So, every ``interval_s``, for each assigned partition of the topics the agents read:

* the records waiting there: its end offset (read on a thread of its own by the admin client,
  ListOffsets, independent of the fetcher that may be stuck; read_committed for exactly-once)
  minus the consumer's position (Faust's ``Consumer.position``);
* progress: an event the agents consumed from it (:meth:`StallWatch.consumed`), or a position
  that moved (records taken from the fetcher).

Records waiting with no progress for ``stall_s`` (:class:`~pipeline.observability.health.
PartitionProgress`): /healthz says so, and the partition is sought to its position through Faust's
consumer (``Consumer.seek_wait``, public), which drops whatever aiokafka buffered for it and wakes
its fetcher; Faust delivers from that offset on, so nothing is skipped. Still stalled ``stall_s``
later: the gateway exits (non-zero) and its supervisor starts a new one, which redoes from the last
commit with fresh connections. Table recovery pauses the partitions on purpose, and
:class:`~pipeline.gateway.faust_compat.RecoveryWatch` watches it: no stall is counted meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable

from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from pipeline.config import Settings
from pipeline.observability.health import Events, PartitionProgress

log = logging.getLogger(__name__)

CAUSE = "fetch_stalled"
#: A rebalance (not counting table recovery, which RecoveryWatch watches) that has not ended after
#: this long plus stall_s has hung: seen in make chaos-like faults when Faust's commit at the
#: revocation waits on a frozen node. Longer than any rebalance within the session timeouts.
REBALANCE_S = 60.0

Key = tuple[str, int]


class EndOffsets:
    """The end offsets of the partitions in :attr:`wanted`, read every ``interval_s`` on a thread
    and handed to ``deliver`` (from that thread). A partition whose leader cannot answer is left
    out of that reading."""

    def __init__(self, settings: Settings, deliver: Callable[[dict[Key, int]], None], *, read_committed: bool,
                 interval_s: float = 1.0, timeout_s: float = 5.0):
        self.deliver = deliver
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.isolation = IsolationLevel.READ_COMMITTED if read_committed else IsolationLevel.READ_UNCOMMITTED
        # Short socket and metadata timeouts: a request to a frozen leader fails within
        # ``timeout_s`` (librdkafka's default is a minute), and a moved leader is found soon.
        ms = int(timeout_s * 1000)
        self._config = {**settings.kafka.admin_config(), "client.id": "llmq-gateway-ends", "socket.timeout.ms": ms,
                        "topic.metadata.refresh.interval.ms": ms}
        self.admin = AdminClient(self._config)
        #: Replaced (never changed in place) by the event loop.
        self.wanted: frozenset[Key] = frozenset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmq-gateway-ends", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            wanted = self.wanted
            if wanted:
                self.deliver(self.read(wanted))
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def read(self, wanted) -> dict[Key, int]:
        try:
            futures = self.admin.list_offsets({TopicPartition(t, p): OffsetSpec.latest() for t, p in wanted},
                                              isolation_level=self.isolation, request_timeout=self.timeout_s)
        except (KafkaException, ValueError) as exc:
            log.debug("cannot read end offsets: %s", exc)
            return {}
        ends = {}
        for tp, fut in futures.items():
            try:
                offset = fut.result().offset
            except KafkaException:
                continue  # its leader is away: this partition is judged on the next reading
            if offset >= 0:  # librdkafka's OFFSET_INVALID (-1001) when it got no answer
                ends[(tp.topic, tp.partition)] = offset
        if len(ends) < len(wanted):
            # Seen with a frozen leader: the client kept asking it, its metadata never refreshed,
            # while the partitions had moved. A new client asks the cluster where they are now.
            self.admin = AdminClient(self._config)
        return ends


class StallWatch:
    def __init__(self, app, topics: set[str], stall_s: float, ends: EndOffsets | None, events: Events,
                 give_up: Callable[[str], None], clock=time.monotonic):
        self.app, self.topics = app, topics
        self.ends = ends
        self.events = events
        self.give_up = give_up
        self.progress = PartitionProgress(stall_s, recoveries=1, clock=clock)
        self.clock = clock
        self._end: dict[Key, int] = {}
        self._position: dict[Key, int] = {}
        self._gave_up = False
        #: Since when Faust has been rebalancing (table recovery aside), for REBALANCE_S.
        self._rebalancing_since: float | None = None

    @property
    def interval_s(self) -> float:
        return max(0.2, min(1.0, self.progress.stall_s / 4))

    def consumed(self, topic: str, partition: int) -> None:
        """An agent took an event of ``topic[partition]``."""
        self.progress.consumed((topic, partition))

    def ended(self, ends: dict[Key, int]) -> None:
        """A reading of end offsets (on the event loop)."""
        self._end.update(ends)

    def reason(self) -> str | None:
        return self.rebalance_hung() or self.progress.reason(name=lambda k: f"{k[0]}[{k[1]}]")

    def rebalance_hung(self) -> str | None:
        since = self._rebalancing_since
        if since is None:
            return None
        seconds = self.clock() - since
        if seconds < REBALANCE_S + self.progress.stall_s:
            return None
        return f"a rebalance has not ended for {seconds:.0f} s"

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.ends is not None:
            def deliver(ends):
                if not loop.is_closed():
                    loop.call_soon_threadsafe(self.ended, ends)
            self.ends.deliver = deliver
            self.ends.start()

    def stop(self) -> None:
        if self.ends is not None:
            self.ends.stop()

    async def check(self) -> None:
        from faust.types import TP

        consumer = self.app.consumer
        assigned = {(tp.topic, tp.partition) for tp in consumer.assignment() if tp.topic in self.topics}
        self.progress.assigned(assigned)
        if self.ends is not None:
            self.ends.wanted = frozenset(assigned)
        for key in [k for k in self._position if k not in assigned]:
            del self._position[key]
        # Faust pauses the partitions while it rebalances and recovers the tables: no stall then.
        recovering = bool(self.app.tables.recovery.in_recovery)
        held = bool(self.app.rebalancing or recovering)
        if self.app.rebalancing and not recovering:
            if self._rebalancing_since is None:
                self._rebalancing_since = self.clock()
        else:
            self._rebalancing_since = None
        hung = self.rebalance_hung()
        if hung is not None and not self._gave_up:
            self._gave_up = True
            self.events.stalled("rebalance_hung", hung)
            self.give_up(hung)
        positions: dict[Key, int] = {}
        for key in assigned:
            try:
                position = await asyncio.wait_for(consumer.position(TP(*key)), timeout=1.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 (no position yet: nothing to judge)
                position = None
            if position is None:
                self.progress.waiting(key, 0)
                continue
            positions[key] = position
            if self._position.get(key) != position:
                if key in self._position:
                    self.progress.consumed(key)
                self._position[key] = position
            end = self._end.get(key)
            self.progress.waiting(key, 0 if end is None else end - position, held=held)
        for stall in self.progress.to_recover():
            key = stall.key
            if key not in positions:
                continue
            self.events.recovered(CAUSE, f"{key[0]}[{key[1]}] has had {stall.waiting} records waiting and no event "
                                         f"for {stall.seconds:.0f} s; seeking it to its position {positions[key]}")
            try:
                await consumer.seek_wait({TP(*key): positions[key]})
            except Exception as exc:  # noqa: BLE001 (the exit below follows if the seek did not help)
                log.warning("seeking %s[%d] failed: %s", key[0], key[1], exc)
        given_up = self.progress.given_up()
        if given_up and not self._gave_up:
            self._gave_up = True
            what = ", ".join(f"{s.key[0]}[{s.key[1]}] ({s.waiting} waiting)" for s in given_up)
            detail = f"reads stalled after a seek: {what}, nothing consumed for {given_up[0].seconds:.0f} s"
            self.events.stalled(CAUSE, detail)
            self.give_up(detail)
