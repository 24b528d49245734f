"""Which offsets may be committed: only past messages whose outcome is durably published.

Messages of one partition finish out of order (a short prompt overtakes a long one), but a
Kafka commit is a single position per partition. So the committable position is one past
the last message of the *contiguous* finished prefix: a slow message holds the position
back, and after a crash everything from it on is redelivered rather than lost.
"""

from __future__ import annotations

from collections import deque

TopicPartitionKey = tuple[str, int]


class _Partition:
    __slots__ = ("pending", "finished", "position", "committed")

    def __init__(self) -> None:
        self.pending: deque[int] = deque()  # offsets handed out, in arrival (= offset) order
        self.finished: set[int] = set()  # finished offsets not yet at the head of `pending`
        self.position: int | None = None  # next offset to commit (last contiguous + 1)
        self.committed: int | None = None  # last position handed to commit()


class OffsetTracker:
    def __init__(self) -> None:
        self._partitions: dict[TopicPartitionKey, _Partition] = {}

    def started(self, tp: TopicPartitionKey, offset: int) -> None:
        part = self._partitions.get(tp)
        if part is None:
            part = self._partitions[tp] = _Partition()
        part.pending.append(offset)

    def finished(self, tp: TopicPartitionKey, offset: int) -> None:
        part = self._partitions.get(tp)
        if part is None:
            return  # partition was revoked meanwhile: its new owner redoes the work
        pending = part.pending
        if pending and pending[0] == offset:
            pending.popleft()
            last = offset
            finished = part.finished
            while pending and pending[0] in finished:
                last = pending.popleft()
                finished.discard(last)
            part.position = last + 1
        else:
            part.finished.add(offset)

    def in_flight(self, tp: TopicPartitionKey | None = None) -> int:
        if tp is not None:
            part = self._partitions.get(tp)
            return len(part.pending) if part else 0
        return sum(len(p.pending) for p in self._partitions.values())

    def to_commit(self, only: set[TopicPartitionKey] | None = None) -> list[tuple[TopicPartitionKey, int]]:
        """Positions that moved since the last call (for ``only`` these partitions)."""
        out = []
        for tp, part in self._partitions.items():
            if only is not None and tp not in only:
                continue
            if part.position is not None and part.position != part.committed:
                out.append((tp, part.position))
        return out

    def mark_committed(self, positions: list[tuple[TopicPartitionKey, int]]) -> None:
        for tp, pos in positions:
            part = self._partitions.get(tp)
            if part is not None:
                part.committed = pos

    def commit_failed(self, positions: list[tuple[TopicPartitionKey, int]]) -> None:
        """An asynchronous commit did not take: report these positions again next time."""
        for tp, pos in positions:
            part = self._partitions.get(tp)
            if part is not None and part.committed == pos:
                part.committed = None

    def forget(self, tp: TopicPartitionKey) -> None:
        self._partitions.pop(tp, None)

    def partitions(self) -> list[TopicPartitionKey]:
        return list(self._partitions)
