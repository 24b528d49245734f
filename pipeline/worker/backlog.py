"""A band's taken-but-not-started requests: one FIFO per partition, served round-robin. Pure.

The gateway keys dispatch topics by tenant, so partitions stand for groups of tenants
(stochastic fair queuing). Serving a band's partitions in turn, rather than in fetch order,
keeps a tenant with a deep backlog in one partition from delaying a quiet tenant in another:
the quiet one waits for at most one request per busy partition, not for the whole backlog.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Iterable


class PartitionQueues:
    def __init__(self):
        self._queues: dict[Hashable, deque] = {}
        self._turn: deque = deque()  # partitions with work, the next to serve first
        self.size = 0  # an attribute, not only len(): the worker reads it for every dispatch

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    def depth(self, partition: Hashable) -> int:
        queue = self._queues.get(partition)
        return len(queue) if queue is not None else 0

    def append(self, partition: Hashable, item) -> int:
        """Queue ``item``; returns the partition's depth."""
        queue = self._queues.get(partition)
        if queue is None:
            queue = self._queues[partition] = deque()
        if not queue:
            self._turn.append(partition)
        queue.append(item)
        self.size += 1
        return len(queue)

    def appendleft(self, partition: Hashable, item, *, turn_first: bool = True) -> None:
        """Put ``item`` back at the head of ``partition``'s queue (a preempted request: it was
        that partition's oldest until it started). ``turn_first``: a partition that had nothing
        queued is served next; otherwise it waits for its turn after the others."""
        queue = self._queues.get(partition)
        if queue is None:
            queue = self._queues[partition] = deque()
        if not queue:
            if turn_first:
                self._turn.appendleft(partition)
            else:
                self._turn.append(partition)
        queue.appendleft(item)
        self.size += 1

    def peek(self):
        """The item :meth:`popleft` would return (IndexError when empty)."""
        return self._queues[self._turn[0]][0]

    def popleft(self):
        """The oldest item of the partition whose turn it is (IndexError when empty)."""
        partition = self._turn[0]
        queue = self._queues[partition]
        item = queue.popleft()
        self.size -= 1
        if queue:
            self._turn.rotate(-1)
        else:
            self._turn.popleft()
        return item

    def pop_last(self, partition: Hashable):
        """Take back the item just appended to ``partition``."""
        queue = self._queues[partition]
        item = queue.pop()
        self.size -= 1
        if not queue:
            self._turn.remove(partition)
        return item

    def drop(self, partitions: Iterable[Hashable]) -> int:
        """Forget everything queued for ``partitions``; returns how many items."""
        dropped = 0
        for partition in partitions:
            queue = self._queues.pop(partition, None)
            if queue:
                dropped += len(queue)
                self._turn.remove(partition)
        self.size -= dropped
        return dropped
