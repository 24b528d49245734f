"""The request ids the gateway saw recently, so that a re-submitted id is answered once.

In memory: request id → :class:`Seen` (where the request came from, what was decided, and what
the completion needs to settle: its band, model and charged tokens), for ``horizon_ms``. Durable:
a Faust table with one record per request partition and flush (its key names the partition, see
:func:`pipeline.gateway.partitions.partition_key`; its value is the ids first seen there in that
flush), written when the tenants' records are, and read back into memory after every rebalance. Its changelog deletes records after twice the horizon; the gateway deletes the ones
of its own partitions as they pass the horizon.

A request redelivered after a crash comes from the same offset as its first copy: it is not a
re-submission, and goes through admission again.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from pipeline.gateway.partitions import Ownership, key_partition, partition_key


class Seen(NamedTuple):
    source: str  # "topic:partition:offset" of the first copy
    tenant: str
    at_ms: int  # when it was decided (a dispatched request's admitted_at)
    dispatched: int = -1  # rank of the band it was dispatched to; -1: answered by the gateway
    model: str = ""  # the model it was dispatched for
    charged: int = 0  # tokens charged to the buckets, settled by the completion
    degraded_from: str = ""
    in_flight: bool = False  # dispatched, and its terminal answer not seen yet
    status: str = ""  # the gateway's own answer: status, reason, retry-after, band
    reason: str = ""
    retry_after_ms: int = 0
    served: int = -1
    arrived_ms: int = 0  # the buckets' clock at the decision (to charge them again the same way)
    not_before_ms: int = 0  # shaped by a rate limit: not to start before (dispatched again the same way)


class SeenDecisions:
    """The decision on each request id seen within the horizon (a :class:`Seen`), in memory and
    in the table."""

    def __init__(self, table, ownership: Ownership, horizon_ms: int):
        self.table = table
        self.ownership = ownership
        self.horizon_ms = horizon_ms
        self._ids: dict[str, Seen] = {}
        self._order: deque[tuple[int, str]] = deque()  # (at_ms, id), oldest first
        self._new: dict[int, list] = {}  # partition → [[id, *Seen], ...] first seen since the last flush
        self._written: deque[tuple[int, bytes]] = deque()  # (flush ms, key) of this gateway's partitions
        self._stamp = 0  # the last flush's key stamp: two flushes in one millisecond get two keys

    def get(self, request_id: str) -> Seen | None:
        return self._ids.get(request_id)

    def recorded(self) -> list[Seen]:
        """Every decision remembered (after :meth:`load`: this gateway's and the others')."""
        return list(self._ids.values())

    def add(self, request_id: str, partition: int, seen: Seen) -> None:
        if request_id in self._ids:
            return
        self._ids[request_id] = seen
        self._order.append((seen.at_ms, request_id))
        self._new.setdefault(partition, []).append([request_id, *seen])

    def finished(self, request_id: str, partition: int) -> Seen | None:
        """The terminal response of a dispatched request came back: what it was charged, once."""
        seen = self._ids.get(request_id)
        if seen is None or not seen.in_flight:
            return None
        self._ids[request_id] = seen._replace(in_flight=False)
        self._new.setdefault(partition, []).append([request_id])  # a one-field entry: "finished"
        return seen

    def flush(self, now_ms: int) -> int:
        """Write the ids first seen since the last flush; forget (and delete) the ones past the horizon."""
        new, self._new = self._new, {}
        table = self.table
        self._stamp = stamp = max(now_ms, self._stamp + 1)
        for partition, entries in new.items():
            key = partition_key(partition, b"%d" % stamp)
            table[key] = entries
            self._written.append((stamp, key))
        horizon = now_ms - self.horizon_ms
        ids, order = self._ids, self._order
        while order and order[0][0] < horizon:
            at, request_id = order.popleft()
            seen = ids.get(request_id)
            if seen is not None and seen.at_ms == at:
                del ids[request_id]
        written = self._written
        while written and written[0][0] < horizon:
            _, key = written.popleft()
            if key in table:
                del table[key]
        return len(new)

    def load(self, now_ms: int) -> int:
        """Rebuild memory from the table (after a rebalance: what other gateways saw comes with it)."""
        self._ids.clear()
        self._order.clear()
        self._written.clear()
        horizon = now_ms - self.horizon_ms
        restored, owned, finished = [], [], set()
        for key, entries in list(self.table.items()):
            partition, flushed = key_partition(key), _flushed(key)
            if partition is not None and self.ownership.owns(partition):
                owned.append((flushed, key))
            for entry in entries or ():
                if not isinstance(entry, list) or not entry:
                    continue  # a record of another shape: not ours to read
                request_id, *fields = entry  # [id, *Seen], or [id] once its request finished
                if not fields:
                    finished.add(request_id)
                    continue
                try:
                    seen = Seen(*fields)
                except TypeError:
                    continue  # a record of another shape: not ours to read
                if seen.at_ms >= horizon:
                    restored.append((seen.at_ms, request_id, seen))
        self._written.extend(sorted(owned))
        for at, request_id, seen in sorted(restored, key=lambda r: r[0]):
            if request_id not in self._ids:
                self._ids[request_id] = seen._replace(in_flight=False) if request_id in finished else seen
                self._order.append((at, request_id))
        return len(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def _flushed(key: bytes) -> int:
    """When a record was written; a key of another form counts as long expired."""
    try:
        return int(key.rpartition(b"\x1f")[2])
    except ValueError:
        return 0
