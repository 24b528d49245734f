"""How many requests a new one waits behind, in the order workers serve them. Pure, no I/O.

Workers serve bands strictly (every higher band first) and, inside a band, its tenants in turn
by tokens (``policy/fair_queue.py``). The gateway sees the dispatch topics' depths per partition,
not per tenant, so it models each partition as one flow served in turn: one request of each
partition with work, then the next round (the dispatch records are keyed by tenant, so a
partition is a group of tenants; a quiet tenant sharing a partition with a backlog is served
sooner than this says, at its own turn, and the quote errs long). A new request
that is the k-th of its partition therefore waits for everything in the higher bands, for its
own partition's k − 1, and for about k of every other partition of its band (or all it has): a tenant alone
on a short partition is served within a round however deep its neighbours' backlogs are, and a
tenant with a deep backlog waits for it, the way the workers actually serve them. And while it
waits, the other partitions' new requests take their turns too: a partition with a backlog
drains at its max-min fair share of the band's drain (:func:`fair_share`), not at all of it.
"""

from __future__ import annotations

from typing import Sequence


def served_in_turn(queues: Sequence[float], n: float) -> list[float]:
    """``queues`` after ``n`` requests were served from them in turn (water-filling: every queue
    loses the same number, or all it has)."""
    if n <= 0:
        return list(queues)
    total = sum(queues)
    if n >= total:
        return [0.0] * len(queues)
    level, left, rest = 0.0, n, sorted(q for q in queues if q > 0)
    # Raise the level queue by queue: the shortest ones empty first.
    for i, q in enumerate(rest):
        width = len(rest) - i
        step = q - level
        if step * width >= left:
            level += left / width
            break
        left -= step * width
        level = q
    return [max(0.0, q - level) for q in queues]


def ahead_of(bands: Sequence[Sequence[float]], rank: int, partition: int | None,
             served: float) -> tuple[float, float, float]:
    """The requests served before a new one of band ``rank`` in ``partition`` (None: unknown, so
    first come first served over the band), once ``served`` more of the current ones are gone
    (highest band first). ``bands[b][p]``: requests waiting in band ``b``'s partition ``p``.
    Returns (that many, how many of them are the higher bands', k: the new request's place in
    its partition)."""
    higher = 0.0
    for b in range(rank):
        total = sum(bands[b])
        if served >= total:
            served -= total
        else:
            higher += total - served
            served = 0.0
    queues = served_in_turn(bands[rank], served)
    if partition is None or not 0 <= partition < len(queues):
        own = sum(queues)
        return higher + own, higher, own + 1.0
    k = queues[partition] + 1.0  # the new request is the k-th of its partition
    # Another partition is served k times before it or k − 1, by where the turn stands: half a
    # request each, on average.
    others = sum(min(q, k - 0.5) for i, q in enumerate(queues) if i != partition)
    return higher + (k - 1.0) + others, higher, k


def fair_share(capacity: float, others: Sequence[float]) -> float:
    """The drain a partition with a backlog gets when the workers serve partitions in turn and
    the ``others`` keep arriving at their rates: max-min fair (an other that asks for less than
    an equal share takes what it asks, the rest is split evenly)."""
    left, rest = capacity, sorted(r for r in others if r > 0)
    for i, rate in enumerate(rest):
        even = left / (len(rest) - i + 1)
        if rate >= even:
            return even
        left -= rate
    return left


class Calibration:
    """What the model does not see (hand-offs, the workers' read-ahead, turns it does not know
    of), learnt from the waits answers report: per band and per partition, whose errors differ.

    The wait predicted for each request (only on trusted evidence: a guess says nothing of the
    model) is remembered until its answer tells the wait it got; each answer moves the
    correction by ``weight`` of its error, capped at ``max_error_ms``."""

    def __init__(self, *, bands: int, weight: float = 0.05, max_error_ms: float = 5_000.0,
                 max_predicted: int = 50_000):
        self.weight = weight
        self.max_error_ms = max_error_ms
        self.max_predicted = max_predicted
        self._band = [0.0] * bands
        self._partition: dict[tuple[int, int], float] = {}
        self._predicted: dict[str, tuple[int, int | None, float]] = {}  # id → (band, partition, ms)

    def predicted(self, request_id: str, rank: int, partition: int | None, wait_ms: float) -> None:
        predicted = self._predicted
        if len(predicted) >= self.max_predicted:
            del predicted[next(iter(predicted))]  # the oldest: its answer is long overdue
        predicted[request_id] = (rank, partition, wait_ms)

    def answered(self, request_id: str, rank: int, wait_ms: float) -> None:
        entry = self._predicted.pop(request_id, None)
        if entry is None or entry[0] != rank:
            return
        _, partition, quoted = entry
        error = min(max(wait_ms - quoted, -self.max_error_ms), self.max_error_ms)
        self._band[rank] += (error - self._band[rank]) * self.weight
        if partition is not None:
            key = (rank, partition)
            bias = self._partition.get(key, 0.0)
            self._partition[key] = bias + (error - bias) * self.weight

    def bias_ms(self, rank: int, partition: int | None = None) -> float:
        """The correction to add to a prediction (the band's, where the partition is unknown)."""
        return self._band[rank] if partition is None else self._partition.get((rank, partition), 0.0)
