"""Whether an llmq process is live (still making progress) and ready (serving): the judgement.

Every long-lived process (gateway, worker, serve, lag exporter) answers ``GET /healthz`` and
``GET /readyz`` from a :class:`Health`: named checks, each returning None (fine) or a short
reason. A supervisor (Kubernetes' liveness probe, compose's healthcheck) restarts a process that
is not live; a load balancer or a rollout waits for one that is not ready.

Live does not mean "the web server answers": a gateway whose fetcher has stopped while its
group still heartbeats holds its partitions for ever, and nothing else would restart it. So the
main live check is progress: :class:`PartitionProgress` is fed, per assigned partition, with the
records waiting there and the times something was consumed from it, and calls a partition
stalled once records have waited ``stall_s`` with nothing consumed. A partition the process
holds back on purpose (a worker's backpressure: its queues are full and it paused the partition)
is not stalled; progress elsewhere in the process (calls finishing) is the process's business.

:class:`Pending` judges the other two ways of standing still: a producer with records
outstanding and no delivery for longer than its timeout, a transaction open for longer than its.

Nothing here does I/O or reads a clock of its own: the processes feed it, and tests drive it with
a fake clock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable

log = logging.getLogger(__name__)

#: A check: None when fine, else why not (short; no secrets, no paths).
Check = Callable[[], "str | None"]

LIVE, READY = "live", "ready"


class Health:
    """Named checks behind /healthz (live) and /readyz (ready). A process that is not live is not
    ready either: readiness runs the live checks too."""

    def __init__(self) -> None:
        self._checks: dict[str, dict[str, Check]] = {LIVE: {}, READY: {}}

    def add_live(self, name: str, check: Check) -> None:
        self._checks[LIVE][name] = check

    def add_ready(self, name: str, check: Check) -> None:
        self._checks[READY][name] = check

    def reasons(self, kind: str) -> list[str]:
        """Each failing check of ``kind`` (and, for ready, of live), as ``"name: reason"``."""
        kinds = (LIVE,) if kind == LIVE else (LIVE, READY)
        out = []
        for k in kinds:
            for name, check in list(self._checks[k].items()):
                try:
                    reason = check()
                except Exception as exc:  # noqa: BLE001 (a broken check says so; it never hides the others)
                    reason = f"check failed ({type(exc).__name__})"
                if reason:
                    out.append(f"{name}: {reason}")
        return out

    def answer(self, kind: str) -> tuple[int, dict[str, Any]]:
        """The HTTP status and JSON body of /healthz (``kind`` live) or /readyz (ready)."""
        reasons = self.reasons(kind)
        if not reasons:
            return 200, {"status": "ok", "checks": sorted({*self._checks[LIVE], *(
                self._checks[READY] if kind == READY else ())})}
        return 503, {"status": "not live" if kind == LIVE else "not ready", "reasons": reasons}


@dataclass
class Stall:
    """A partition whose records have waited ``seconds`` with nothing consumed from it."""

    key: Hashable
    waiting: int
    seconds: float
    #: How often the process tried to recover it already (since anything was last consumed).
    recoveries: int


@dataclass
class _Partition:
    waiting: int = 0
    #: Since when records have waited (and not been held back on purpose); None: none wait.
    waiting_since: float | None = None
    consumed_at: float | None = None
    recoveries: int = 0


class PartitionProgress:
    """Per assigned partition: records waiting, the last time one was consumed, and what to do
    about a stall: recover it (up to ``recoveries`` times, each followed by another ``stall_s``
    of waiting), then give up (the process exits and its supervisor restarts it)."""

    def __init__(self, stall_s: float, recoveries: int = 1, clock: Callable[[], float] = time.monotonic):
        self.stall_s = stall_s
        self.recoveries = recoveries
        self.clock = clock
        self._parts: dict[Hashable, _Partition] = {}

    @property
    def partitions(self) -> set:
        return set(self._parts)

    def assigned(self, keys: Iterable[Hashable]) -> None:
        """The partitions assigned now: new ones start fresh, the others are forgotten."""
        keys = set(keys)
        for key in [k for k in self._parts if k not in keys]:
            del self._parts[key]
        for key in keys:
            self._parts.setdefault(key, _Partition())

    def consumed(self, key: Hashable, at: float | None = None) -> None:
        """Something was consumed from ``key`` (at ``at``): progress."""
        part = self._parts.get(key)
        if part is not None:
            part.consumed_at = self.clock() if at is None else at
            part.recoveries = 0

    def waiting(self, key: Hashable, records: int, *, held: bool = False, at: float | None = None) -> None:
        """``records`` wait in ``key`` now; ``held``: the process holds them back on purpose
        (paused for backpressure), which is no stall."""
        part = self._parts.get(key)
        if part is None:
            return
        part.waiting = max(0, records)
        if part.waiting == 0 or held:
            part.waiting_since = None
            part.recoveries = 0
        elif part.waiting_since is None:
            part.waiting_since = self.clock() if at is None else at

    def stalls(self, now: float | None = None) -> list[Stall]:
        now = self.clock() if now is None else now
        out = []
        for key, part in self._parts.items():
            if part.waiting_since is None:
                continue
            since = part.waiting_since if part.consumed_at is None else max(part.waiting_since, part.consumed_at)
            if now - since >= self.stall_s:
                out.append(Stall(key, part.waiting, now - since, part.recoveries))
        return out

    def to_recover(self, now: float | None = None) -> list[Stall]:
        """The stalled partitions to try to recover now (each then gets another ``stall_s``)."""
        now = self.clock() if now is None else now
        out = []
        for stall in self.stalls(now):
            if stall.recoveries < self.recoveries:
                part = self._parts[stall.key]
                part.recoveries += 1
                part.waiting_since = now  # a fresh wait: the recovery's chance to work
                out.append(stall)
        return out

    def given_up(self, now: float | None = None) -> list[Stall]:
        """The stalled partitions whose recoveries did not help: the process should exit."""
        return [s for s in self.stalls(now) if s.recoveries >= self.recoveries]

    def reason(self, now: float | None = None, name: Callable[[Hashable], str] = str) -> str | None:
        """The live check: None, or which partitions are stalled."""
        stalls = self.stalls(now)
        if not stalls:
            return None
        stalls.sort(key=lambda s: -s.seconds)
        shown = ", ".join(f"{name(s.key)} ({s.waiting} waiting, nothing consumed for {s.seconds:.0f} s)"
                          for s in stalls[:5])
        more = f" and {len(stalls) - 5} more" if len(stalls) > 5 else ""
        return f"stalled: {shown}{more}"


class Pending:
    """Something outstanding that must end within ``timeout_s``: records a producer has not had
    acknowledged (progress = a delivery), or open transactions (each must end in time)."""

    def __init__(self, timeout_s: float, what: str, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.what = what
        self.clock = clock
        self._since: float | None = None
        self._done = -1

    def observe(self, outstanding: int, done_total: int, now: float | None = None) -> None:
        """``outstanding`` records wait for an acknowledgement; ``done_total``: deliveries so far."""
        now = self.clock() if now is None else now
        if outstanding <= 0 or done_total != self._done:
            self._since = now if outstanding > 0 else None
        self._done = done_total

    def reason(self, now: float | None = None) -> str | None:
        if self._since is None or not self.timeout_s:
            return None
        now = self.clock() if now is None else now
        if now - self._since >= self.timeout_s:
            return f"{self.what} outstanding with nothing acknowledged for {now - self._since:.0f} s"
        return None

    @staticmethod
    def oldest(started: Iterable[float], timeout_s: float, what: str, now: float) -> str | None:
        """Of things started at ``started`` (monotonic times), the one open past ``timeout_s``."""
        ages = [now - t for t in started]
        if ages and timeout_s and max(ages) >= timeout_s:
            return f"{what} open for {max(ages):.0f} s (limit {timeout_s:.0f} s)"
        return None


class Events:
    """Counts recoveries and stalls (``llmq_health_recoveries_total{cause}``,
    ``llmq_health_stalls_total{cause}``) and logs each once with its cause. ``recoveries`` and
    ``stalls``: the processes' metric series (labels ``cause``), or None."""

    def __init__(self, recoveries=None, stalls=None):
        self._recoveries, self._stalls = recoveries, stalls

    def recovered(self, cause: str, detail: str) -> None:
        if self._recoveries is not None:
            self._recoveries.labels(cause).inc()
        log.warning("recovering (%s): %s", cause, detail)

    def stalled(self, cause: str, detail: str) -> None:
        if self._stalls is not None:
            self._stalls.labels(cause).inc()
        log.error("not live (%s): %s; exiting so that the supervisor restarts this process", cause, detail)
