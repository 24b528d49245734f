"""Bounded per-band queues and backpressure: depth, drain rate, load, position, ETA, retry-after.
Pure, no I/O.

A band's queue is its dispatch topic: what the gateways wrote there and the workers have not yet
committed. The gateway observes that from the topic's offsets (every instance sees the same
numbers, so caps, positions and ETAs are global) and adds what it admitted itself since the last
observation. From the same offsets come the *drain rate* (committed offsets advancing) and the
*arrival rate* (end offsets advancing), both smoothed with a time constant of a few seconds.

*ETA*, per band and tenant: the requests served before a new one, in the order workers serve
them (every higher band first; inside the band, its partitions in turn: :mod:`pipeline.policy.eta`)
as the last reading had them, less what drained since and what is already running, plus what was
admitted here since; over the drain that band gets: the workers' *capacity* (their drain while
work waited for them, :mod:`pipeline.policy.capacity`) less what the higher bands keep bringing,
but at least the band's minimum share. Capacity outlives an idle spell, so the first burst after
a quiet night is judged by the last measured capacity; before anything was measured the ETA is
unknown (inf), never a guess. A request is refused as unable to meet its deadline only against
:meth:`QueueModel.eta_floor_ms`, the wait at twice the fastest recent capacity (room for more
workers), and only when recent saturated readings back it.

*Load*, per band, is how long work in that band waits, relative to ``target_queue_ms``: the queue
wait that the band's finished requests report (``started_at − admitted_at``, smoothed, fading
once nothing waits), or, once the queue ahead of a new request is deep, its ETA, whichever is
longer. A BACKGROUND backlog, which is there by design, is no load for NORMAL. When the workers
slow down or disappear under load, the capacity they show falls, and waits and ETAs grow with it;
a backlog that does not drain at all is overload.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

from pipeline.models import BANDS
from pipeline.policy.capacity import Capacity
from pipeline.policy.eta import Calibration, ahead_of, fair_share

N_BANDS = len(BANDS)


class QueueVerdict(NamedTuple):
    full: bool
    position: int  # 1-based: requests served before it (higher bands, its band in the workers' turns) + 1
    eta_ms: float  # estimated wait before a worker starts it (inf: unknown)
    retry_after_ms: int = 0
    #: The shortest wait the evidence allows (0: too little recent evidence to say): a deadline
    #: shorter than this cannot be met, whatever the estimate's error.
    eta_floor_ms: float = 0.0


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
    """Depth and drain of each band; ``caps[rank]`` bounds a band's depth (0 = unbounded).

    ``commit_lag_ms``: how long a finished request stays in the depth before its worker commits
    it (about the workers' commit interval). ``optimism``: how much faster than the fastest
    recent drain the workers may become (more of them start) before a request is refused as
    unable to meet its deadline.
    """

    def __init__(self, caps: list[int], *, default_rate_per_s: float = 0.0, min_retry_ms: int = 100,
                 max_retry_ms: int = 60_000, target_queue_ms: float = 2_000.0, tau_ms: float = 3_000.0,
                 deep: int = 100, commit_lag_ms: float = 500.0, optimism: float = 2.0,
                 capacity: Capacity | None = None, partition_of: Callable[[str], int] | None = None,
                 min_shares: list[float] | None = None, max_predicted: int = 50_000):
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
        self.commit_lag_ms = commit_lag_ms
        self.optimism = optimism
        self.capacity = capacity or Capacity(tau_ms=tau_ms)
        self._wait_ms = [0.0] * N_BANDS
        self._waited_at: list[float | None] = [None] * N_BANDS
        self._service_ms: float | None = None  # started → finished, smoothed over every band
        self._observed = [0] * N_BANDS  # the depths of the last observation
        self._local = [0] * N_BANDS  # admitted here since then
        #: The dispatch partition of a tenant's requests; with the partitions' depths, the ETA
        #: follows the workers' turns between partitions (policy/eta.py).
        self.partition_of = partition_of
        self._parts: list[list[int]] = [[0] for _ in range(N_BANDS)]  # per band, per partition
        self._local_parts: list[dict[int, int]] = [{} for _ in range(N_BANDS)]
        self._memo: tuple | None = None  # (key, ahead) of the last _ahead
        self._queue_cache: list[list[float]] | None = None  # see _queues
        self.calibration = Calibration(bands=N_BANDS, max_predicted=max_predicted)
        self._drain = Rate(tau_ms)
        self._arrivals = Rate(tau_ms)
        #: Per band: what arrives (a lower band waits for the higher bands' new work too), and
        #: the share the workers keep for it however busy the higher bands are (worker.band_min_share).
        # Slow (30 s): a burst that arrived is in the depths already; what counts is what goes on arriving.
        self._band_arrivals = [Rate(30_000.0) for _ in range(N_BANDS)]
        self.min_shares = list(min_shares) if min_shares is not None else [0.0] * N_BANDS
        self._part_arrivals: list[list[Rate]] = [[] for _ in range(N_BANDS)]  # per band, per partition
        self._drained: int | None = None  # the last observation's drain total
        self._at: float | None = None  # ... and its time
        self.observations = 0

    # -- what the gateway tells it -------------------------------------------------------

    def observe(self, depths: list[int], arrived_total: int, drained_total: int, now_ms: float,
                partitions: list[list[int]] | None = None, arrived: list[int] | None = None,
                ends: list[list[int]] | None = None) -> None:
        """The dispatch topics' offsets: per band, end minus committed (and the same per band and
        partition, if known); over all bands, the sums of end and of committed offsets (running
        totals)."""
        depths = [max(0, d) for d in depths]
        self._parts = ([[max(0, d) for d in band] for band in partitions] if partitions is not None
                       else [[d] for d in depths])
        self._local_parts = [{} for _ in range(N_BANDS)]
        self._queue_cache = None
        self._memo = None
        if self._drained is not None and self._at is not None and drained_total >= self._drained:
            backlog = min(sum(self._observed), sum(depths))
            self.capacity.pipeline_ms = (self._service_ms or 0.0) + self.commit_lag_ms
            self.capacity.observe(drained_total - self._drained, now_ms - self._at, backlog,
                                  self._pipeline(), now_ms)
        self._observed = depths
        self._local = [0] * N_BANDS
        self._drained, self._at = drained_total, now_ms
        self._drain.observe(drained_total, now_ms)
        self._arrivals.observe(arrived_total, now_ms)
        if arrived is not None:
            for rate, total in zip(self._band_arrivals, arrived):
                rate.observe(total, now_ms)
        if ends is not None:
            for b, band in enumerate(ends):
                rates = self._part_arrivals[b]
                if len(rates) != len(band):
                    rates[:] = [Rate(self.tau_ms) for _ in band]
                for rate, total in zip(rates, band):
                    rate.observe(total, now_ms)
        self.observations += 1

    def admitted(self, rank: int, tenant: str | None = None, request_id: str | None = None,
                 now_ms: float | None = None) -> None:
        """A request was admitted to band ``rank``. With its id, the wait the model predicts for it
        is remembered, to calibrate the model by the wait its completion reports."""
        if request_id is not None and (now_ms is None or self.capacity.trusted(now_ms)):
            # Only predictions made on recent evidence calibrate: a guess before the capacity was
            # measured says nothing of the model.
            rate = self._rate_for(rank, self.capacity_per_s())
            if rate > 0:
                self.calibration.predicted(request_id, rank, self._partition(tenant),
                                           self._ahead(rank, now_ms, tenant) * 1000.0 / rate)
        self._local[rank] += 1
        p = self._partition(tenant)
        if p is not None:
            local = self._local_parts[rank]
            local[p] = local.get(p, 0) + 1
        band = self._queue_cache[rank] if self._queue_cache is not None else None
        if band is not None:
            if p is not None and p < len(band):
                band[p] += 1.0
            else:
                self._queue_cache = None
        self._memo = None

    def waited(self, rank: int, wait_ms: float, now_ms: float, service_ms: float | None = None,
               request_id: str | None = None) -> None:
        """A finished request of band ``rank`` waited ``wait_ms`` before a worker started it, and
        then ran ``service_ms``."""
        if request_id is not None:
            self.calibration.answered(request_id, rank, wait_ms)
        last, self._waited_at[rank] = self._waited_at[rank], now_ms
        weight = 1.0 if last is None else 1.0 - math.exp(-max(0.0, now_ms - last) / self.tau_ms)
        self._wait_ms[rank] += (max(0.0, wait_ms) - self._wait_ms[rank]) * weight
        if service_ms is not None and service_ms >= 0:
            s = self._service_ms
            self._service_ms = float(service_ms) if s is None else s + (service_ms - s) * 0.05

    # -- estimates ------------------------------------------------------------------------

    @property
    def depth(self) -> list[int]:
        return [o + local for o, local in zip(self._observed, self._local)]

    def capacity_per_s(self) -> float:
        """The workers' drain while they have work (requests/s; 0: not known yet)."""
        return self.capacity.per_s or self.default_rate

    def drain_rate(self) -> float:
        """What the workers drained recently (requests/s), busy or not."""
        return self._drain.per_s if self.observations > 1 else self.default_rate

    def arrival_rate(self) -> float:
        return self._arrivals.per_s if self.observations > 1 else 0.0

    def _pipeline(self) -> float:
        """How many requests of a depth no longer wait: running in a worker, or finished and not
        yet committed (Little's law: drain × time through the workers). The drain is the recent
        one, or the capacity if that is higher (after an idle spell the recent drain is nothing,
        yet a burst fills the workers at once)."""
        rate = max(self.drain_rate(), self.capacity.per_s or 0.0)
        return rate * ((self._service_ms or 0.0) + self.commit_lag_ms) / 1000.0

    def _partition(self, tenant: str | None) -> int | None:
        return None if tenant is None or self.partition_of is None else self.partition_of(tenant)

    def _ahead(self, rank: int, now_ms: float | None, tenant: str | None = None) -> float:
        """The requests a new one of band ``rank`` (and ``tenant``'s partition, if known) would
        wait behind, in the order workers serve them (policy/eta.py).

        The last reading's depths count what finished and is not yet committed (about half a
        commit interval of drain) and miss what drained since (at the capacity); the requests
        the workers are running (capacity × service time: their slots) wait no more; what this
        gateway admitted since comes on top."""
        return self._place(rank, now_ms, tenant)[0]

    def _queues(self) -> list[list[float]]:
        """Per band and partition: the last reading's depths plus what was admitted here since
        (built once a reading, then kept up by :meth:`admitted`)."""
        queues = self._queue_cache
        if queues is None:
            queues = self._queue_cache = []
            for b in range(N_BANDS):
                band = [float(d) for d in self._parts[b]]
                unplaced = self._local[b] - sum(self._local_parts[b].values())
                for p, n in self._local_parts[b].items():
                    if p < len(band):
                        band[p] += n
                    else:
                        unplaced += n
                if unplaced:  # admitted without a known partition: spread over the band
                    band = [q + unplaced / len(band) for q in band]
                queues.append(band)
        return queues

    def _place(self, rank: int, now_ms: float | None, tenant: str | None) -> tuple[float, float]:
        """(:meth:`_ahead`, the requests of the tenant's own partition before it: what FIFO
        inside a partition makes a sure lower bound; the band's whole count if unknown)."""
        partition = self._partition(tenant)
        key = (rank, partition, now_ms)
        memo = self._memo
        if memo is not None and memo[0] == key:
            return memo[1]
        served = max(self.drain_rate(), self.capacity_per_s()) * (self._service_ms or 0.0) / 1000.0
        if sum(self._observed[: rank + 1]):
            served += self.drain_rate() * self.commit_lag_ms / 2000.0
            if now_ms is not None and self._at is not None and now_ms > self._at:
                served += self.capacity_per_s() * (now_ms - self._at) / 1000.0
        ahead, higher, k = ahead_of(self._queues(), rank, partition, served)
        if partition is not None and k > 1.0:
            # A backlog in its partition: it drains at the partition's fair share of the band's
            # drain while the other partitions' arrivals take their turns: their rates, or what
            # was admitted to them here since the last reading, if faster (a burst under way).
            rate = self._rate_for(rank, self.capacity_per_s())
            since_s = max(0.25, ((now_ms or 0.0) - (self._at or 0.0)) / 1000.0)
            local = self._local_parts[rank]
            others = [max(r.per_s, local.get(i, 0) / since_s)
                      for i, r in enumerate(self._part_arrivals[rank]) if i != partition]
            share = fair_share(rate, others)
            if 0 < share < rate:
                ahead = max(ahead, higher + (k - 0.5) * rate / share)
        placed = (ahead, k - 1.0 if partition is not None else ahead)
        self._memo = (key, placed)
        return placed

    def queued_ms(self) -> float:
        """How long the work in every band takes to drain at the capacity (inf: nothing drains)."""
        return self.eta_ms(N_BANDS - 1)

    def _rate_for(self, rank: int, capacity: float) -> float:
        """The drain a band's waiting requests get from ``capacity``: what the higher bands'
        arrivals leave of it (they are served first), but at least the band's minimum share."""
        if rank == 0 or capacity <= 0:
            return capacity
        higher = sum(self._band_arrivals[b].per_s for b in range(rank))
        return max(capacity - higher, capacity * self.min_shares[rank], capacity * 0.01)

    def eta_ms(self, rank: int, now_ms: float | None = None, tenant: str | None = None) -> float:
        """How long a request admitted to band ``rank`` now waits before a worker starts it
        (inf: unknown, nothing measured yet)."""
        return self._calibrated(rank, tenant, _eta_ms(self._ahead(rank, now_ms, tenant),
                                                      self._rate_for(rank, self.capacity_per_s())))

    def _calibrated(self, rank: int, tenant: str | None, eta: float) -> float:
        if eta == float("inf"):
            return eta
        return max(0.0, eta + self.calibration.bias_ms(rank, self._partition(tenant)))

    def eta_floor_ms(self, rank: int, now_ms: float | None = None, tenant: str | None = None) -> float:
        """The shortest wait the evidence allows: the wait at ``optimism`` times the fastest
        recent drain, or 0 without enough recent saturated readings (never refuse on a guess)."""
        at = self._at if now_ms is None else now_ms
        if at is None or not self.capacity.trusted(at):
            return 0.0
        fastest = self.capacity.fastest(at) * self.optimism
        if fastest <= 0:
            return 0.0
        # Only what surely goes first: inside a partition the workers keep the order, so its own
        # predecessors, even were the whole drain theirs.
        _, surely = self._place(rank, now_ms, tenant)
        known = self._partition(tenant) is not None
        return _eta_ms(surely, fastest if known else self._rate_for(rank, fastest))

    def load(self, rank: int, now_ms: float | None = None) -> float:
        """How long work in band ``rank`` waits, over ``target_queue_ms`` (1.0: that long), at most 10."""
        wait = self._wait_ms[rank]
        waited_at = self._waited_at[rank]
        now = self._at if now_ms is None else now_ms
        if wait and waited_at is not None and now is not None and self._ahead(rank, now_ms) <= 0:
            # Nothing waits in the band now: what finished requests reported fades with time.
            wait *= math.exp(-max(0.0, now - waited_at) / self.tau_ms)
        if sum(self.depth[: rank + 1]) >= self.deep:
            queued = self.eta_ms(rank, now_ms)
            if queued == float("inf"):
                # A backlog that does not drain at all: overloaded, once the rates have been seen.
                return 10.0 if self.observations > 3 else min(10.0, wait / self.target_queue_ms)
            wait = max(wait, queued)
        return min(10.0, wait / self.target_queue_ms)

    def check(self, rank: int, cap: int | None = None, now_ms: float | None = None,
              tenant: str | None = None) -> QueueVerdict:
        """Whether band ``rank`` has room for one more (under ``cap``, by default its own), and
        where ``tenant``'s request would stand: its position (1-based) and ETA in the workers'
        order."""
        depth = self.depth
        ahead = self._ahead(rank, now_ms, tenant)
        eta = self._calibrated(rank, tenant, _eta_ms(ahead, self._rate_for(rank, self.capacity_per_s())))
        position = int(round(ahead)) + 1
        cap = self.caps[rank] if cap is None else cap
        if cap and depth[rank] >= cap:
            # Until the band has drained below its cap at the measured capacity.
            rate = self.capacity_per_s()
            excess = depth[rank] - cap + 1
            retry = excess * 1000.0 / rate if rate > 0 else self.max_retry_ms
            retry_ms = int(min(max(retry, self.min_retry_ms), self.max_retry_ms))
            return QueueVerdict(True, position, eta, retry_ms)
        return QueueVerdict(False, position, eta, 0, self.eta_floor_ms(rank, now_ms, tenant))

    def snapshot(self) -> dict:
        """What ``GET /v1/queue`` shows."""
        depth = self.depth
        at = self._at or 0.0
        return {"drain_rate_per_s": round(self.drain_rate(), 2), "arrival_rate_per_s": round(self.arrival_rate(), 2),
                "capacity_per_s": round(self.capacity_per_s(), 2), "capacity_evidence": self.capacity.evidence(at),
                "queued_ms": _finite(self.queued_ms()),
                "bands": {p.value: {"depth": depth[p.rank], "cap": self.caps[p.rank],
                                    "eta_ms": _finite(self.eta_ms(p.rank)),
                                    "wait_ms": round(self._wait_ms[p.rank], 1),
                                    "eta_bias_ms": round(self.calibration.bias_ms(p.rank), 1),
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

    def load(self, rank: int, now_ms: float | None = None) -> float:
        return self.model.load(rank, now_ms)

    def eta_ms(self, rank: int, now_ms: float | None = None, tenant: str | None = None) -> float:
        return self.model.eta_ms(rank, now_ms, tenant)

    def check(self, rank: int, now_ms: float | None = None, tenant: str | None = None) -> QueueVerdict:
        return self.model.check(rank, self.caps[rank], now_ms, tenant)

    def admitted(self, rank: int, tenant: str | None = None, request_id: str | None = None,
                 now_ms: float | None = None) -> None:
        """Not counted: the shadow admits nothing."""


def _eta_ms(ahead: int, rate: float) -> float:
    """The wait behind ``ahead`` requests at ``rate`` completions a second."""
    if ahead == 0:
        return 0.0
    return ahead * 1000.0 / rate if rate > 0 else float("inf")


def _finite(x: float) -> float | None:
    return None if x == float("inf") else round(x, 1)
