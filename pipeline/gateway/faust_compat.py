"""The shims llmq keeps on faust-streaming: the consumer's fetch wait (and fetch minimum), and a
watch on table recovery.

Upstream: robinhood/faust#281, "Make fetch_max_wait_ms configurable" (open since January 2019).
faust-streaming, the maintained fork, still builds its aiokafka consumer with
``fetch_max_wait_ms=1500`` written into ``AIOKafkaConsumerThread._create_worker_consumer``,
and no Faust setting reaches it.

Why it matters here: aiokafka keeps one fetch in flight per broker, and leaves out of it every
partition that still has records waiting in its buffer. A fetch sent while the busy bands'
partitions were being handed over asks only for the idle ones (an empty BACKGROUND band, the
response topic between answers), and the broker holds it until ``fetch_max_wait_ms`` runs out.
The busy partitions are fetched again only after that, so with 1.5 s a request's admission
waits about 1.5 s however light the load (docs/gateway.md, "How much one gateway takes").
Faust also leaves ``fetch_min_bytes`` at aiokafka's 1: under a trickle of requests every record
or two costs a whole fetch, encoded and decoded in Python for every assigned partition.

What the shim does: a transport whose consumer thread builds the consumer exactly as Faust
does (``super()``), then sets the wait and the minimum before the consumer starts, where aiokafka
reads them into its fetcher. Nothing of Faust or aiokafka is replaced or patched; a few private
names are used (the method overridden, the attributes set, and for exactly-once the isolation
level and Faust's commit future), and only on the versions below, where they were read. On any other version the gateway runs on
Faust's stock transport (the 1.5 s wait) and says so once; ``tests/unit/gateway/
test_faust_compat.py`` fails as soon as the installed versions differ, so that the shim is
checked again (or dropped, if upstream made the wait a setting) when the pin moves.

The transport is registered under the ``llmq`` URL scheme through Faust's documented
``faust.transports`` entry point (pyproject.toml).

For ``gateway.processing_guarantee = "exactly-once"`` (pipeline/gateway/transactions.py) the same
consumer also reads read_committed (Faust sets that only for its own exactly_once), and
:func:`commits_held` keeps Faust's periodic commit out of the way of the gateway's transactions
through the future Faust itself uses to let one commit run at a time (``Consumer._commit_fut``).

**Recovery that never ends** (:class:`RecoveryWatch`). Seen in the scale-out test: after two
rebalances in a row, a gateway's recovery of an active changelog partition logged "No event
received for active tp ... since recovery start" for minutes, and the gateway admitted nothing.
Faust pauses every partition at a rebalance, and its drain loop passes that (empty) set of active
partitions to aiokafka's ``getmany``, which reads an empty set as "no filter"; a ``getmany`` still
waiting from before the rebalance can then take the changelog records Recovery has just sought
to, and Faust drops them ("getmany called while flow not active"), while aiokafka's position has
moved to the end. Recovery waits for records nobody will fetch again. Related upstream:
robinhood/faust#69 (pausing during a getmany fetched every partition), faust-streaming/faust#253
and #256 (a fetch after assignment discarded; the fallback re-seeks committed offsets only, never
a changelog's). The watch uses Faust's public consumer interface: an active changelog partition
with records left, none applied for ``stall_s``, and a consumer position past what Recovery has
applied is sought back there (``Consumer.seek_wait``); Recovery applies only records past what it
has, so reading some again is harmless. ``stream_recovery_delay`` would avoid the race too, at the
cost of that delay on every failover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from importlib import metadata
from typing import Any

import aiokafka
from faust.transport.drivers import aiokafka as faust_aiokafka

log = logging.getLogger(__name__)

UPSTREAM_ISSUE = "https://github.com/robinhood/faust/pull/281"
#: The versions whose code the shim was written against (and tested with).
WRITTEN_FOR = {"faust-streaming": "0.15.3", "aiokafka": "0.14.0"}
#: The URL scheme of the shimmed transport (the entry point's name in pyproject.toml).
SCHEME = "llmq"
#: The wait Faust hard-codes, used when the shim is off.
FAUST_WAIT_MS = 1500

#: The fetch wait and fetch minimum the shimmed consumers get (ms, bytes): gateway.fetch_max_wait_ms
#: and gateway.fetch_min_bytes, set by the gateway (set_fetch_wait) before its app creates a
#: consumer. Process-wide, as a gateway is a process.
_fetch_wait_ms = 10
_fetch_min_bytes = 65_536
_isolation_level = "read_uncommitted"  # aiokafka's default, as Faust leaves it at at_least_once


def set_fetch_wait(ms: int, min_bytes: int = 65_536) -> None:
    global _fetch_wait_ms, _fetch_min_bytes
    _fetch_wait_ms, _fetch_min_bytes = int(ms), int(min_bytes)


def set_read_committed(on: bool) -> None:
    """Exactly-once: what the gateway counts (workers' answers) is only what they committed."""
    global _isolation_level
    _isolation_level = "read_committed" if on else "read_uncommitted"


@contextlib.asynccontextmanager
async def commits_held(consumer):
    """Faust commits no offset while inside: a regular commit that reaches the group after a
    transaction's offsets (and before that transaction ends) would win over them, taking the
    group back to an offset whose outputs are committed already. Faust's ``commit`` waits for a
    commit in progress and then skips its own; a commit of Faust's in progress is waited for
    here first, so that it lands before the transaction's offsets."""
    while (running := consumer._commit_fut) is not None:
        await asyncio.wait([running])
    mine = consumer._commit_fut = asyncio.get_running_loop().create_future()
    try:
        yield
    finally:
        if consumer._commit_fut is mine:
            consumer._commit_fut = None
        if not mine.done():
            mine.set_result(None)


def installed_versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in WRITTEN_FOR}


def applies() -> bool:
    """Whether the installed Faust and aiokafka are the ones the shim was written for."""
    return installed_versions() == WRITTEN_FOR


def broker_scheme() -> str:
    """The scheme for the gateway's broker URLs: the shimmed transport where it applies,
    Faust's own (``kafka``) elsewhere, said once in the log."""
    if applies():
        return SCHEME
    log.warning("faust fetch-wait shim off: written for %s, installed %s; the gateway's consumer "
                "waits up to %d ms a fetch (Faust's hard-coded value, %s)",
                WRITTEN_FOR, installed_versions(), FAUST_WAIT_MS, UPSTREAM_ISSUE)
    return "kafka"


class ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> aiokafka.AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        # Read by AIOKafkaConsumer.start() into its Fetcher; the consumer has not started yet.
        consumer._fetch_max_wait_ms = _fetch_wait_ms
        consumer._fetch_min_bytes = _fetch_min_bytes
        consumer._isolation_level = _isolation_level
        return consumer


class Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> ConsumerThread:
        return ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class Transport(faust_aiokafka.Transport):
    """Faust's aiokafka transport, its consumer's fetch wait set by llmq (robinhood/faust#281)."""

    Consumer = Consumer


class RecoveryWatch:
    """Seeks an active changelog partition back to where Recovery stands when Recovery has waited
    ``stall_s`` for its records while the consumer's position is past them (see the module)."""

    def __init__(self, app, stall_s: float = 3.0, clock=time.monotonic):
        self.app = app
        self.stall_s = stall_s
        self.clock = clock
        #: (generation, tp) → (the offset Recovery stood at, since when)
        self._waiting: dict[tuple, tuple[int, float]] = {}
        self.sought = 0

    async def check(self) -> None:
        recovery = self.app.tables.recovery
        if not recovery.in_recovery:
            self._waiting.clear()
            return
        now, generation = self.clock(), self.app.consumer_generation_id
        offsets = recovery.active_offsets
        for tp, remaining in recovery.active_remaining().items():
            if remaining <= 0:
                continue
            key, offset = (generation, tp), offsets[tp]
            stood = self._waiting.get(key)
            if stood is None or stood[0] != offset:
                self._waiting[key] = (offset, now)  # new, or Recovery moved on: wait afresh
                continue
            if now - stood[1] < self.stall_s:
                continue
            self._waiting[key] = (offset, now)
            at = max(offset, 0)
            position = await self.app.consumer.position(tp)
            if self.app.consumer_generation_id != generation:
                continue
            if position is None or position <= at + 1:
                log.info("table recovery of %s[%d] has had no record for %.0f s (at offset %d, %d to go; the "
                         "consumer is at %s)", tp.topic, tp.partition, self.stall_s, at, remaining, position)
                continue
            log.warning("table recovery of %s[%d] has had no record for %.0f s although the consumer is at "
                        "offset %d, past %d: seeking back (faust-streaming drops a fetch taken across a "
                        "rebalance; see pipeline/gateway/faust_compat.py)", tp.topic, tp.partition,
                        self.stall_s, position, at)
            await self.app.consumer.seek_wait({tp: at})
            self.sought += 1
