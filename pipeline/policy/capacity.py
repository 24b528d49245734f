"""How fast the workers drain the dispatch queues when they have work. Pure, no I/O.

The gateway sees the workers only through the dispatch topics' offsets: what they committed
(drained) over an interval. A drain measured while the workers had work waiting is their
*capacity*; a drain measured while they kept up is only the arrival rate, a lower bound of it;
an interval with nothing to do says nothing at all. So:

- **Idle is not slow.** An interval with nothing queued leaves the estimate as it was, however
  long the idle spell: the first burst of the morning is judged by yesterday's capacity.
- **Lost capacity is seen.** An interval in which work waited the whole time and little or
  nothing drained pulls the estimate down (workers slowed, crashed or gone).
- **Evidence is counted.** Each saturated interval is a sample; refusing a request early needs a
  few recent ones (:meth:`Capacity.evidence`), and uses the fastest recent estimate
  (:meth:`Capacity.fastest`), so that a thin or stale estimate never turns work away.

Workers commit every so often, so an interval in which nothing was committed counts together
with the next one that was; intervals with nothing committed are a sample (of zero) on their own
only once they have lasted longer than a request takes through the workers.

"Work waited the whole time" is told from the depth at both ends of the interval against the
*pipeline*: the requests counted in the depth that no longer wait (running in a worker, or
finished and not yet committed), about drain rate × (service time + commit lag).
"""

from __future__ import annotations

import math
from collections import deque


class Capacity:
    """The workers' drain capacity (requests/s over every band), from saturated intervals.

    The estimate is the drain over the latest ``window_ms`` of saturated time (however long ago
    that was): an average over whole intervals, with no warm-up from zero and no decay while
    idle."""

    def __init__(self, *, window_ms: float = 5_000.0, tau_ms: float = 3_000.0, evidence_ms: float = 10_000.0,
                 min_evidence: int = 4, stall_ms: float = 2_000.0):
        self.window_ms = window_ms
        self.tau_ms = tau_ms
        #: Work queued with nothing drained for this long (or four times ``pipeline_ms``, if
        #: longer) means the workers drain nothing: samples of zero.
        self.stall_ms = stall_ms
        #: A request's way through the workers: service time + commit lag (set by the queue model).
        self.pipeline_ms = 0.0
        self._pending_ms = 0.0  # intervals with work queued and nothing committed, not yet counted
        self._pending_backlog: int | None = None
        self.evidence_ms = evidence_ms
        self.min_evidence = min_evidence
        #: (at_ms, drained, dt_ms) of the latest saturated intervals, ``window_ms`` of them.
        self._samples: deque[tuple[float, int, float]] = deque()
        self._drained = 0  # their sums
        self._span_ms = 0.0
        self._floor = 0.0  # smoothed drain of intervals with some work: a lower bound

    @property
    def busy_per_s(self) -> float | None:
        """The drain of the latest saturated intervals (None: none seen)."""
        return self._drained * 1000.0 / self._span_ms if self._span_ms > 0 else None

    @property
    def per_s(self) -> float | None:
        """The estimate (requests/s), or None before any interval with work was seen."""
        busy = self.busy_per_s
        if busy is None:
            return self._floor or None
        return max(busy, self._floor)

    def observe(self, drained: int, dt_ms: float, backlog: int, pipeline: float, now_ms: float) -> None:
        """``drained`` requests committed over ``dt_ms``; ``backlog``: the smaller of the queue's
        depths at the two ends (over every band); ``pipeline``: how many of a depth do not wait."""
        if dt_ms <= 0 or drained < 0:
            return
        if backlog <= 0 and drained == 0:
            self._pending_ms, self._pending_backlog = 0.0, None
            return  # idle: nothing to learn
        if self._pending_backlog is not None:
            backlog = min(backlog, self._pending_backlog)
        if drained == 0:
            # Work queued and nothing committed: the workers commit every so often, so the drain
            # of this interval comes with the next commit, and counts over both intervals. A
            # stall longer than a request's way through the workers means they drain nothing.
            self._pending_ms += dt_ms
            self._pending_backlog = backlog
            if self._pending_ms < max(self.stall_ms, 4.0 * self.pipeline_ms):
                return
            dt_ms, saturated = self._pending_ms, True
        else:
            dt_ms += self._pending_ms
            saturated = backlog > max(1.0, 2.0 * pipeline)
        self._pending_ms, self._pending_backlog = 0.0, None
        if saturated:
            # Work waited throughout: the workers drained as fast as they could.
            samples = self._samples
            samples.append((now_ms, drained, dt_ms))
            self._drained += drained
            self._span_ms += dt_ms
            while len(samples) > 1 and self._span_ms - samples[0][2] >= self.window_ms:
                _, n, dt = samples.popleft()
                self._drained -= n
                self._span_ms -= dt
            # The lower bound must not hold up an estimate that saw the workers slow down.
            self._floor = min(self._floor, self.busy_per_s or 0.0)
        else:
            # They kept up: at least this fast, maybe much faster.
            self._floor += (drained * 1000.0 / dt_ms - self._floor) * (1.0 - math.exp(-dt_ms / self.tau_ms))

    def evidence(self, now_ms: float) -> int:
        """Saturated intervals seen within the last ``evidence_ms``."""
        horizon = now_ms - self.evidence_ms
        return sum(1 for at, _, _ in self._samples if at >= horizon)

    def trusted(self, now_ms: float) -> bool:
        """Whether the estimate rests on enough recent saturated intervals to refuse work on."""
        return self.evidence(now_ms) >= self.min_evidence

    def fastest(self, now_ms: float) -> float:
        """The fastest drain of the recent saturated intervals, or the estimate if higher (0: none)."""
        horizon = now_ms - self.evidence_ms
        recent = [n * 1000.0 / dt for at, n, dt in self._samples if at >= horizon and dt > 0]
        return max(recent + [self.busy_per_s or 0.0]) if recent else 0.0
