"""Bounded per-band queues and backpressure: depth, drain rate, position, ETA, retry-after.
Pure, no I/O.

The gateway cannot see inside the workers, so a band's *depth* is what it admitted and has not
yet seen finished on the response topic. The *drain rate* is the rate of those completions over
a sliding window; *capacity* is the best drain rate seen recently, so *load* (arrivals over
capacity) says how close the pipeline is to saturation.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from pipeline.models import Priority

N_BANDS = len(Priority)
_new = tuple.__new__  # a NamedTuple built from a tuple: its keyword-parsing __new__ costs ~0.5 us


class RateMeter:
    """Events per second over the last ``window_ms``, in 1-second buckets."""

    def __init__(self, window_ms: int = 10_000, bucket_ms: int = 1_000):
        self.bucket_ms = bucket_ms
        self.buckets = max(1, window_ms // bucket_ms)
        self._counts: deque[list[int]] = deque()  # [bucket_start, count]
        self._total = 0  # of the counts (asked for on every admission decision)
        self._first_ms: int | None = None
        # The last rate asked for, and at which ms: an admission asks several times a
        # decision, and at thousands a second many decisions share a millisecond.
        self._rate_ms: int | None = None
        self._rate = 0.0
        self._span_ms = 1

    def add(self, now_ms: int, n: int = 1) -> None:
        counts = self._counts
        start = now_ms - now_ms % self.bucket_ms
        if now_ms == self._rate_ms and counts and counts[-1][0] == start:
            # In the millisecond of the last rate, into its newest bucket: nothing ages out and
            # the span is the same, so the rate is kept up to date instead of recomputed.
            counts[-1][1] += n
            self._total += n
            self._rate = self._total * 1000.0 / self._span_ms
            return
        self._rate_ms = None
        if self._first_ms is None:
            self._first_ms = now_ms
        if counts and counts[-1][0] == start:
            counts[-1][1] += n
        else:
            counts.append([start, n])
        self._total += n
        self._trim(now_ms)

    def _trim(self, now_ms: int) -> None:
        oldest = now_ms - self.buckets * self.bucket_ms
        counts = self._counts
        while counts and counts[0][0] <= oldest:
            self._total -= counts.popleft()[1]

    def rate(self, now_ms: int) -> float:
        if now_ms == self._rate_ms:
            return self._rate
        self._trim(now_ms)
        if not self._counts or self._first_ms is None:
            rate = 0.0
        else:
            # Over the time actually observed, so a young meter is not diluted by empty history.
            span_ms = self._span_ms = min(self.buckets * self.bucket_ms, max(now_ms - self._first_ms, self.bucket_ms))
            rate = self._total * 1000.0 / span_ms
        self._rate_ms, self._rate = now_ms, rate
        return rate


class QueueVerdict(NamedTuple):
    full: bool
    position: int  # 1-based: requests ahead of it (this and higher bands) + 1
    eta_ms: float  # estimated wait before a worker starts it
    retry_after_ms: int = 0


class QueueModel:
    """Depth and drain of each band; ``caps[rank]`` bounds a band's depth (0 = unbounded)."""

    def __init__(self, caps: list[int], *, default_rate_per_s: float = 0.0, window_ms: int = 10_000,
                 min_retry_ms: int = 100, max_retry_ms: int = 60_000):
        assert len(caps) == N_BANDS
        self.caps = list(caps)
        self.depth = [0] * N_BANDS
        self.default_rate = default_rate_per_s
        self._drain = RateMeter(window_ms)
        self._arrivals = RateMeter(window_ms)
        self._capacity = 0.0
        self.min_retry_ms = min_retry_ms
        self.max_retry_ms = max_retry_ms

    # -- events ---------------------------------------------------------------------------

    def admitted(self, rank: int, now_ms: int) -> None:
        self.depth[rank] += 1
        self._arrivals.add(now_ms)

    def finished(self, rank: int, now_ms: int) -> None:
        if self.depth[rank] > 0:
            self.depth[rank] -= 1
        self._drain.add(now_ms)

    # -- estimates ------------------------------------------------------------------------

    def drain_rate(self, now_ms: int) -> float:
        rate = self._drain.rate(now_ms)
        if rate > self._capacity:
            self._capacity = rate
        return rate or self.default_rate

    def capacity(self, now_ms: int) -> float:
        self.drain_rate(now_ms)
        return self._capacity or self.default_rate

    def load(self, now_ms: int) -> float:
        """Arrival rate over measured capacity (0 before any capacity was measured)."""
        return self.outlook(now_ms)[1]

    def outlook(self, now_ms: int) -> tuple[float, float]:
        """``(drain_rate, load)`` at ``now_ms``: what an admission decision reads, once."""
        rate = self.drain_rate(now_ms)
        cap = self._capacity or self.default_rate
        return rate, (self._arrivals.rate(now_ms) / cap if cap > 0 else 0.0)

    def ahead(self, rank: int) -> int:
        """Requests a new one in band ``rank`` waits behind: its own band and every higher one."""
        return sum(self.depth[: rank + 1])

    def eta_ms(self, rank: int, now_ms: int, rate: float | None = None) -> float:
        """``rate``: the drain rate at ``now_ms``, if the caller has it already."""
        return _eta_ms(sum(self.depth[: rank + 1]), self.drain_rate(now_ms) if rate is None else rate)

    def check(self, rank: int, now_ms: int, rate: float | None = None) -> QueueVerdict:
        """Whether band ``rank`` has room for one more, and where it would stand (``rate``:
        the drain rate at ``now_ms``, if the caller has it already)."""
        if rate is None:
            rate = self.drain_rate(now_ms)
        depth = self.depth
        ahead = sum(depth[: rank + 1])
        eta = _eta_ms(ahead, rate)
        cap = self.caps[rank]
        if cap and depth[rank] >= cap:
            # Until the band has drained below its cap at the current rate.
            excess = depth[rank] - cap + 1
            retry = excess * 1000.0 / rate if rate > 0 else self.max_retry_ms
            retry_ms = int(min(max(retry, self.min_retry_ms), self.max_retry_ms))
            return _new(QueueVerdict, (True, ahead + 1, eta, retry_ms))
        return _new(QueueVerdict, (False, ahead + 1, eta, 0))

    def snapshot(self, now_ms: int) -> dict:
        """What ``GET /v1/queue`` shows."""
        rate = self.drain_rate(now_ms)
        return {"drain_rate_per_s": round(rate, 2), "capacity_per_s": round(self.capacity(now_ms), 2),
                "load": round(self.load(now_ms), 3),
                "bands": {p.value: {"depth": self.depth[p.rank], "cap": self.caps[p.rank],
                                    "eta_ms": _finite(self.eta_ms(p.rank, now_ms))} for p in Priority}}


def _eta_ms(ahead: int, rate: float) -> float:
    """The wait behind ``ahead`` requests at ``rate`` completions a second."""
    if ahead == 0:
        return 0.0
    return ahead * 1000.0 / rate if rate > 0 else float("inf")


def _finite(x: float) -> float | None:
    return None if x == float("inf") else round(x, 1)
