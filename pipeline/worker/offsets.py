"""Which offsets may be committed: only past messages whose outcome is durably published.

Messages of one partition finish out of order (a short prompt overtakes a long one), but a
Kafka commit is a single position per partition. So the committable position is one past
the last message of the *contiguous* finished prefix: a slow message holds the position
back, and after a crash everything from it on is redelivered rather than lost.
"""

from __future__ import annotations

from collections import deque

#: Commit metadata lists the offsets finished past the committed position, so the next owner of
#: the partition skips them instead of answering them twice (only duplicates are at stake: a
#: list cut short, unreadable or absent just means redoing work). Brokers cap commit metadata at
#: offset.metadata.max.bytes, 4096 by default.
METADATA_PREFIX = "llmq.done1:"
MAX_METADATA_CHARS = 4000

TopicPartitionKey = tuple[str, int]


def encode_done(position: int, done: set[int] | list[int]) -> str:
    """``done`` (offsets > ``position``) as ranges relative to ``position``: "3,7+2" = 3, 7, 8, 9."""
    parts = []
    size = len(METADATA_PREFIX)
    run_start = prev = None
    for off in sorted(done):
        if prev is not None and off == prev + 1:
            prev = off
            continue
        if run_start is not None:
            item = _run(run_start - position, prev - run_start)
            size += len(item) + 1
            if size > MAX_METADATA_CHARS:
                return METADATA_PREFIX + ",".join(parts)
            parts.append(item)
        run_start = prev = off
    if run_start is not None:
        item = _run(run_start - position, prev - run_start)
        if size + len(item) + 1 <= MAX_METADATA_CHARS:
            parts.append(item)
    return METADATA_PREFIX + ",".join(parts) if parts else ""


def _run(start: int, extra: int) -> str:
    return f"{start}+{extra}" if extra else str(start)


def decode_done(position: int, metadata: str | None) -> set[int]:
    """The offsets listed by :func:`encode_done`; anything unreadable yields what was readable."""
    if not metadata or not metadata.startswith(METADATA_PREFIX) or position < 0:
        return set()
    out: set[int] = set()
    for item in metadata[len(METADATA_PREFIX):].split(","):
        start, _, extra = item.partition("+")
        try:
            first, count = int(start), int(extra or 0)
        except ValueError:
            break
        if first <= 0 or count < 0 or len(out) + count > 1_000_000:
            break
        out.update(range(position + first, position + first + count + 1))
    return out


class _Partition:
    __slots__ = ("pending", "finished", "position", "committed", "committed_done")

    def __init__(self) -> None:
        self.pending: deque[int] = deque()  # offsets handed out, in arrival (= offset) order
        self.finished: set[int] = set()  # finished offsets not yet at the head of `pending`
        self.position: int | None = None  # next offset to commit (last contiguous + 1)
        self.committed: int | None = None  # last position handed to commit()
        self.committed_done = 0  # how many finished-beyond offsets that commit listed


class OffsetTracker:
    def __init__(self) -> None:
        self._partitions: dict[TopicPartitionKey, _Partition] = {}

    def started(self, tp: TopicPartitionKey, offset: int) -> None:
        part = self._partitions.get(tp)
        if part is None:
            part = self._partitions[tp] = _Partition()
        part.pending.append(offset)

    def started_many(self, tp: TopicPartitionKey, offsets: list[int]) -> None:
        """:meth:`started` for each of ``offsets`` (ascending), at once."""
        part = self._partitions.get(tp)
        if part is None:
            part = self._partitions[tp] = _Partition()
        part.pending.extend(offsets)

    def finished_many(self, tp: TopicPartitionKey, offsets: list[int]) -> None:
        """:meth:`finished` for each of ``offsets`` (ascending), at once where they are the
        partition's oldest pending offsets (the usual case)."""
        part = self._partitions.get(tp)
        if part is None or not offsets:
            return
        pending, k = part.pending, len(offsets)
        # pending and offsets both ascend and offsets ⊆ pending: equal ends mean equal lists.
        if len(pending) >= k and pending[0] == offsets[0] and pending[k - 1] == offsets[-1]:
            if k == len(pending):
                pending.clear()
            else:
                popleft = pending.popleft
                for _ in range(k):
                    popleft()
            last = offsets[-1]
            finished = part.finished
            while pending and pending[0] in finished:
                last = pending.popleft()
                finished.discard(last)
            part.position = last + 1
            return
        for offset in offsets:
            self.finished(tp, offset)

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

    def to_commit_with_done(self, only: set[TopicPartitionKey] | None = None
                            ) -> list[tuple[TopicPartitionKey, int, str]]:
        """Like :meth:`to_commit`, with commit metadata listing the offsets finished past each
        position; a partition also comes up when only that list grew (a slow message at the
        head holds the position while the ones behind it finish)."""
        out = []
        for tp, part in self._partitions.items():
            if only is not None and tp not in only:
                continue
            position = part.position
            if position is None:
                if not part.finished or not part.pending:
                    continue
                position = part.pending[0]  # nothing contiguous yet: the head itself
            if position != part.committed or len(part.finished) != part.committed_done:
                out.append((tp, position, encode_done(position, part.finished)))
        return out

    def mark_committed_with_done(self, positions: list[tuple[TopicPartitionKey, int, str]]) -> None:
        for tp, pos, _ in positions:
            part = self._partitions.get(tp)
            if part is not None:
                part.committed = pos
                part.committed_done = len(part.finished)

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
                part.committed_done = -1

    def forget(self, tp: TopicPartitionKey) -> None:
        self._partitions.pop(tp, None)

    def partitions(self) -> list[TopicPartitionKey]:
        return list(self._partitions)
