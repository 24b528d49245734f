"""Bounded per-band queues and backpressure: depth, drain rate, load, position, ETA, retry-after.
Pure, no I/O.

A band's queue is its dispatch topic: what the gateways wrote there and the workers have not yet
committed. The gateway observes that from the topic's offsets (every instance sees the same
numbers, so caps, positions and ETAs are global) and adds what it admitted itself since the last
observation. From the same offsets come the *drain rate* (committed offsets advancing) and the
*arrival rate* (end offsets advancing), both smoothed with a time constant of a few seconds.

*Load*, per band, is how long work in that band waits, relative to ``target_queue_ms``: the queue
wait that the band's finished requests report (``started_at − admitted_at``, smoothed), or, once
the queue ahead of a new request is deep, the time it takes to drain at the current rate,
whichever is longer. A BACKGROUND backlog, which is there by design, is no load for NORMAL. It needs no estimate of the workers'
capacity, which the gateway cannot measure while they keep up (drain then equals arrivals,
whatever they could do). When the workers slow down or disappear, waits and drain times grow and
the load rises with them; a backlog that does not drain at all is overload.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from pipeline.models import BANDS

N_BANDS = len(BANDS)


class QueueVerdict(NamedTuple):
    full: bool
    position: int  # 1-based: requests ahead of it (this and higher bands) + 1
    eta_ms: float  # estimated wait before a worker starts it (inf: unknown)
    retry_after_ms: int = 0


class Rate:
    """An event rate smoothed exponentially over ``tau_ms``, fed with running totals."""

    def __init__(self, tau_ms: float = 3_000.0):
        self.tau_ms = tau_ms
        self.per_s = 0.0
        self._total: int | None = None
        self._at: float | None = None

    def observe(self, total: int, now_ms: float) -> None:
        if self._total is None or now_ms <= self._at or total < self._total:
            # First sample, or the totals were reset (topics recreated): start over from here.
            self._total, self._at = total, now_ms
            return
        dt = now_ms - self._at
        sample = (total - self._total) * 1000.0 / dt
        weight = 1.0 - math.exp(-dt / self.tau_ms)
        self.per_s += (sample - self.per_s) * weight
        self._total, self._at = total, now_ms


class QueueModel:
    """Depth and drain of each band; ``caps[rank]`` bounds a band's depth (0 = unbounded)."""

    def __init__(self, caps: list[int], *, default_rate_per_s: float = 0.0, min_retry_ms: int = 100,
                 max_retry_ms: int = 60_000, target_queue_ms: float = 2_000.0, tau_ms: float = 3_000.0,
                 deep: int = 100):
        assert len(caps) == N_BANDS
        self.caps = list(caps)
        self.default_rate = default_rate_per_s
        self.min_retry_ms = min_retry_ms
        self.max_retry_ms = max_retry_ms
        self.target_queue_ms = target_queue_ms
        self.tau_ms = tau_ms
        #: A queue this deep (all bands) counts by its drain time too: below it, the requests
        #: in it are mostly the ones workers hold in flight, whatever the rate.
        self.deep = deep
        self._wait_ms = [0.0] * N_BANDS
        self._waited_at: list[float | None] = [None] * N_BANDS
        self._observed = [0] * N_BANDS  # the depths of the last observation
        self._local = [0] * N_BANDS  # admitted here since then
        self._drain = Rate(tau_ms)
        self._arrivals = Rate(tau_ms)
        self.observations = 0

    # -- what the gateway tells it -------------------------------------------------------

    def observe(self, depths: list[int], arrived_total: int, drained_total: int, now_ms: float) -> None:
        """The dispatch topics' offsets: per band, end minus committed; over all bands, the sums
        of end and of committed offsets (running totals)."""
        self._observed = [max(0, d) for d in depths]
        self._local = [0] * N_BANDS
        self._drain.observe(drained_total, now_ms)
        self._arrivals.observe(arrived_total, now_ms)
        self.observations += 1

    def admitted(self, rank: int) -> None:
        self._local[rank] += 1

    def waited(self, rank: int, wait_ms: float, now_ms: float) -> None:
        """A finished request of band ``rank`` waited ``wait_ms`` before a worker started it."""
        last, self._waited_at[rank] = self._waited_at[rank], now_ms
        weight = 1.0 if last is None else 1.0 - math.exp(-max(0.0, now_ms - last) / self.tau_ms)
        self._wait_ms[rank] += (max(0.0, wait_ms) - self._wait_ms[rank]) * weight

    # -- estimates ------------------------------------------------------------------------

    @property
    def depth(self) -> list[int]:
        return [o + local for o, local in zip(self._observed, self._local)]

    def drain_rate(self) -> float:
        return self._drain.per_s if self.observations > 1 else self.default_rate

    def arrival_rate(self) -> float:
        return self._arrivals.per_s if self.observations > 1 else 0.0

    def queued_ms(self) -> float:
        """How long the work in every band takes to drain at the current rate (inf: nothing drains)."""
        return _eta_ms(sum(self.depth), self.drain_rate())

    def load(self, rank: int) -> float:
        """How long work in band ``rank`` waits, over ``target_queue_ms`` (1.0: that long), at most 10."""
        wait = self._wait_ms[rank]
        if sum(self.depth[: rank + 1]) >= self.deep:
            queued = self.eta_ms(rank)
            if queued == float("inf"):
                # A backlog that does not drain at all: overloaded, once the rates have been seen.
                return 10.0 if self.observations > 3 else min(10.0, wait / self.target_queue_ms)
            wait = max(wait, queued)
        return min(10.0, wait / self.target_queue_ms)

    def eta_ms(self, rank: int) -> float:
        return _eta_ms(sum(self.depth[: rank + 1]), self.drain_rate())

    def check(self, rank: int, cap: int | None = None) -> QueueVerdict:
        """Whether band ``rank`` has room for one more (under ``cap``, by default its own), and
        where it would stand."""
        depth = self.depth
        rate = self.drain_rate()
        ahead = sum(depth[: rank + 1])
        eta = _eta_ms(ahead, rate)
        cap = self.caps[rank] if cap is None else cap
        if cap and depth[rank] >= cap:
            # Until the band has drained below its cap at the current rate.
            excess = depth[rank] - cap + 1
            retry = excess * 1000.0 / rate if rate > 0 else self.max_retry_ms
            retry_ms = int(min(max(retry, self.min_retry_ms), self.max_retry_ms))
            return QueueVerdict(True, ahead + 1, eta, retry_ms)
        return QueueVerdict(False, ahead + 1, eta, 0)

    def snapshot(self) -> dict:
        """What ``GET /v1/queue`` shows."""
        depth = self.depth
        return {"drain_rate_per_s": round(self.drain_rate(), 2), "arrival_rate_per_s": round(self.arrival_rate(), 2),
                "queued_ms": _finite(self.queued_ms()),
                "bands": {p.value: {"depth": depth[p.rank], "cap": self.caps[p.rank],
                                    "eta_ms": _finite(self.eta_ms(p.rank)),
                                    "wait_ms": round(self._wait_ms[p.rank], 1),
                                    "load": round(self.load(p.rank), 3)} for p in BANDS}}


class CappedView:
    """A :class:`QueueModel`'s measurements under other caps, read-only: what a shadow policy
    judges with (the real admission alone counts what it admits)."""

    def __init__(self, model: QueueModel, caps: list[int]):
        assert len(caps) == N_BANDS
        self.model = model
        self.caps = list(caps)

    @property
    def depth(self) -> list[int]:
        return self.model.depth

    def load(self, rank: int) -> float:
        return self.model.load(rank)

    def eta_ms(self, rank: int) -> float:
        return self.model.eta_ms(rank)

    def check(self, rank: int) -> QueueVerdict:
        return self.model.check(rank, self.caps[rank])

    def admitted(self, rank: int) -> None:
        """Not counted: the shadow admits nothing."""


def _eta_ms(ahead: int, rate: float) -> float:
    """The wait behind ``ahead`` requests at ``rate`` completions a second."""
    if ahead == 0:
        return 0.0
    return ahead * 1000.0 / rate if rate > 0 else float("inf")


def _finite(x: float) -> float | None:
    return None if x == float("inf") else round(x, 1)
