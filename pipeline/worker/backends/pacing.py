"""Flow control per model server: how many calls to have in flight so the server's own
queue stays near empty while its batch stays full.

A model server queues what it cannot batch yet, first come first served; a call waiting
there has left llmq's priority queues for good. So llmq sends a server only what it can
start now and keeps the rest in its own queues, in priority order. Two ways to know
what a server can start:

* **its metrics** (vLLM's ``vllm:num_requests_running``/``num_requests_waiting`` and
  ``kv_cache_usage_perc``): llmq's own calls are counted exactly, so a sample only says
  what the server's *other* clients hold (``running + waiting`` less what llmq had in
  flight when the sample was taken), and the limit is ``capacity - others``.
  ``capacity`` (slots, across every client of the server) is learned: while requests
  wait (at two samples in a row) with as many running as ever, it is exactly ``running``;
  while none wait and every known slot is busy it is probed above: by one, doubling while
  the server keeps taking the probes, back to one at its first sign of being full. Requests
  waiting while fewer run than the server has run at once only wait for its next step. A
  full KV cache starts nothing more, unless the server runs nothing: no signal may keep an
  idle server idle. A KV reading of full while the server has nothing running or waiting (by
  its metrics) and nothing of llmq's in flight contradicts its state (a server that counts
  its cached free blocks as used reads so for ever): it is counted (``kv_contradictions``),
  and that server's KV reading is not trusted until it reads below the threshold again. A sample older than ``metrics_stale_s`` is not trusted (llm-d's routers guard against
  stale metrics the same way) and the limit below takes over;
* **time to first token** otherwise, AIMD as in TCP: the limit grows by one per limit's
  worth of first tokens that come near the lowest TTFT seen (and only while the limit is
  what holds calls back), and is cut by ``decrease`` when a first token takes more than
  ``slow_ratio`` times that floor, or the server answers 429/503; one cut per round (calls
  started before a cut do not cut again). While metrics are fresh, the TTFT limit follows
  theirs, so a stale sample hands over from what the server could take, not from a guess.

:class:`PacingGate` holds one :class:`ServerPacer` per server and lets callers wait for
a slot; ``available`` answers "how many more can I start now" without waiting.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable


@dataclass(frozen=True)
class PacingConfig:
    #: False: a fixed limit of max_limit per server (no adaptation).
    adaptive: bool = True
    initial_limit: int = 4
    min_limit: int = 1
    max_limit: int = 64
    #: Additive increase: the limit grows by this much per limit's worth of fast first tokens.
    increase: float = 1.0
    #: Multiplicative decrease on a slow first token or an overload answer.
    decrease: float = 0.7
    slow_ratio: float = 2.0
    fast_ratio: float = 1.5
    #: How far the TTFT floor moves toward a slower sample (of the gap), so one lucky sample
    #: does not pin it for ever while a congested server still reads as slow for a long time.
    floor_rise: float = 0.01
    metrics_interval_s: float = 0.05
    metrics_stale_s: float = 0.2
    #: Requests waiting with fewer running than the server's peak for this long: it has fewer
    #: slots now (restarted smaller), and capacity is learned again from what runs.
    shrink_after_s: float = 2.0
    #: KV cache fuller than this: start nothing more even with slots free (vLLM would preempt).
    kv_high: float = 0.95

    def __post_init__(self):
        if not 1 <= self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError("pacing limits must satisfy 1 <= min_limit <= initial_limit <= max_limit")
        if not 0 < self.decrease < 1:
            raise ValueError("pacing decrease must be between 0 and 1")
        if not 1 <= self.fast_ratio <= self.slow_ratio:
            raise ValueError("pacing ratios must satisfy 1 <= fast_ratio <= slow_ratio")


@dataclass(frozen=True)
class ServerLoad:
    """A server's own view of its load, as its metrics said at ``at`` (clock seconds)."""

    running: float
    waiting: float
    kv_usage: float | None
    at: float
    #: Its prefix cache's lifetime counters in tokens (vLLM's prefix_cache_hits/queries), if exported.
    prefix_hits: float | None = None
    prefix_queries: float | None = None


class AimdLimit:
    """The in-flight limit learned from time to first token (pure; times are passed in)."""

    def __init__(self, config: PacingConfig):
        self.config = config
        self.limit = float(config.initial_limit)
        self.floor: float | None = None
        self._last_cut = -math.inf

    def first_token(self, ttft: float, started_at: float, at_limit: bool) -> None:
        cfg = self.config
        if self.floor is None or ttft < self.floor:
            self.floor = ttft
        else:
            self.floor += (ttft - self.floor) * cfg.floor_rise
        if ttft > cfg.slow_ratio * self.floor:
            self.cut(started_at)
        elif ttft <= cfg.fast_ratio * self.floor and at_limit:
            self.limit = min(float(cfg.max_limit), self.limit + cfg.increase / self.limit)

    def cut(self, started_at: float) -> None:
        """Multiplicative decrease, once per round: calls older than the last cut saw the old limit."""
        if started_at < self._last_cut:
            return
        self.limit = max(float(self.config.min_limit), self.limit * self.config.decrease)
        self._last_cut = started_at

    def resume_from(self, limit: float) -> None:
        """While the server's metrics set the limit, they also say where TTFT pacing takes over
        if they go stale, rather than a limit that grew unchecked meanwhile."""
        cfg = self.config
        self.limit = float(min(cfg.max_limit, max(cfg.min_limit, limit)))

    def mark_round(self, now: float) -> None:
        # Only calls started from now on may cut again.
        self._last_cut = max(self._last_cut, now)


@dataclass(eq=False)
class Slot:
    """One call in flight on ``server``, holding what its observations need."""

    server: Hashable
    started_at: float
    at_limit: bool
    released: bool = False
    #: What the routing decided for the call (its prompt's key and the choice), for learning
    #: from the answer.
    key: object = None
    choice: object = None


class ServerPacer:
    def __init__(self, config: PacingConfig, clock: Callable[[], float]):
        self.config = config
        self.clock = clock
        self.aimd = AimdLimit(config)
        self.in_flight = 0
        self.load: ServerLoad | None = None
        self.capacity = config.initial_limit
        #: What the last sample says the server's other clients have running or waiting.
        self.others = 0.0
        self._waited = False
        #: The most requests the server has been seen running at once: it has at least that many slots.
        self.peak = 0
        self._below_peak = 0
        self._probe = 1
        # (time, in_flight after it) of every start and finish since the last sample, so the
        # next sample can be compared with what llmq itself had in flight when it was taken.
        self._history: deque[tuple[float, int]] = deque()
        self._in_flight_before = 0
        #: False once a full KV reading contradicted an idle server, until it reads below kv_high.
        self.kv_trusted = True
        self.kv_contradictions = 0

    def metrics_fresh(self, now: float | None = None) -> bool:
        now = self.clock() if now is None else now
        return self.load is not None and now - self.load.at <= self.config.metrics_stale_s

    @property
    def mode(self) -> str:
        if not self.config.adaptive:
            return "fixed"
        return "metrics" if self.metrics_fresh() else "ttft"

    def limit(self, now: float | None = None) -> int:
        cfg = self.config
        if not cfg.adaptive:
            return cfg.max_limit
        now = self.clock() if now is None else now
        if self.metrics_fresh(now):
            limit = math.floor(self.capacity - self.others)
            kv = self.load.kv_usage
            if kv is not None and kv >= cfg.kv_high and self.kv_trusted:
                limit = min(limit, self.in_flight)
            return int(min(cfg.max_limit, max(0, limit)))
        return int(min(cfg.max_limit, max(cfg.min_limit, math.floor(self.aimd.limit))))

    def available(self, now: float | None = None) -> int:
        return max(0, self.limit(now) - self.in_flight)

    def load_now(self, now: float | None = None) -> float:
        """The calls the server has: llmq's in flight, and its other clients' while metrics are fresh."""
        return self.in_flight + (self.others if self.metrics_fresh(now) else 0.0)

    def start(self, now: float) -> Slot:
        self.in_flight += 1
        at_limit = self.in_flight >= self.limit(now)
        self._history.append((now, self.in_flight))
        return Slot(None, now, at_limit)

    def finish(self, slot: Slot) -> None:
        self.in_flight -= 1
        self._history.append((self.clock(), self.in_flight))

    def _in_flight_at(self, at: float) -> int:
        value = self._in_flight_before
        while self._history and self._history[0][0] <= at:
            value = self._history.popleft()[1]
        self._in_flight_before = value
        return value

    def observe_load(self, load: ServerLoad | None) -> None:
        ours = self._in_flight_at(load.at if load is not None else self.clock())
        if load is None:
            self.load = None
            return
        kv = load.kv_usage
        if kv is not None and kv >= self.config.kv_high:
            if load.running == 0 and load.waiting == 0 and ours == 0 and self.in_flight == 0:
                # Full, and running nothing: the reading cannot be what holds calls back.
                self.kv_trusted = False
                self.kv_contradictions += 1
        elif kv is not None:
            self.kv_trusted = True
        running = int(load.running)
        if load.waiting > 0 and self._waited and running >= self.peak:
            # Requests waited at two samples in a row with as many running as ever: every slot
            # is busy, so that is how many there are. (One sample is not enough: a request
            # waits until the next engine step even with a slot free.)
            self.capacity = max(1, running)
            self._probe = 1
        elif load.waiting > 0 and running < self.peak:
            # Fewer running than the server has run at once: slots are free, and what waits
            # only waits for the next step (at a high arrival rate something nearly always
            # does). Only a long run of such samples says the server shrank (a restart).
            self._below_peak += 1
            if self._below_peak * self.config.metrics_interval_s >= self.config.shrink_after_s:
                self.peak, self.capacity, self._below_peak, self._probe = running, max(1, running), 0, 1
        elif load.waiting == 0 and running >= self.capacity:
            # Every known slot busy and nobody waits: probe above. Each probe the server took
            # doubles the next (a big server is found in a few samples); the first sign that it
            # is full goes back to one, so a full server has at most one more than it can run.
            self.capacity = running + self._probe
            self._probe = min(2 * self._probe, max(1, self.capacity // 2))
        if load.waiting == 0 or running >= self.peak:
            self._below_peak = 0
        self.peak = max(self.peak, running)
        self._waited = load.waiting > 0
        # Calls of ours on their way when the sample was taken are not in it: "others" may
        # come out low by those, never high, and clamping at zero makes it exact for one client.
        self.others = max(0.0, load.running + load.waiting - ours)
        self.load = load
        self.aimd.resume_from(math.floor(self.capacity - self.others))


class PacingGate:
    """Per-server pacers and a wait for a free slot on any of a set of servers."""

    def __init__(self, config: PacingConfig = PacingConfig(), clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._pacers: dict[Hashable, ServerPacer] = {}
        self._changed: asyncio.Event | None = None

    def pacer(self, server: Hashable) -> ServerPacer:
        pacer = self._pacers.get(server)
        if pacer is None:
            pacer = self._pacers[server] = ServerPacer(self.config, self.clock)
        return pacer

    def available(self, server: Hashable) -> int:
        return self.pacer(server).available()

    def limit(self, server: Hashable) -> int:
        return self.pacer(server).limit()

    def in_flight(self, server: Hashable) -> int:
        return self.pacer(server).in_flight

    def load(self, server: Hashable) -> float:
        return self.pacer(server).load_now()

    def try_acquire(self, server: Hashable) -> Slot | None:
        pacer = self.pacer(server)
        now = self.clock()
        if pacer.available(now) <= 0:
            return None
        slot = pacer.start(now)
        slot.server = server
        return slot

    async def acquire(self, choose: Callable[[], Hashable | None], timeout_s: float) -> Slot:
        """A slot on the server ``choose()`` names once it has one free; TimeoutError after ``timeout_s``.

        ``choose`` is asked again whenever a slot frees or a server's load changes, so a
        caller that prefers servers with room gets the first that has some.
        """
        deadline = self.clock() + timeout_s
        while True:
            server = choose()
            if server is not None:
                slot = self.try_acquire(server)
                if slot is not None:
                    return slot
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise TimeoutError("no free slot before the deadline")
            if self._changed is None:
                self._changed = asyncio.Event()
            changed = self._changed
            # A stale sample hands over to the TTFT limit with no event: look again by then.
            try:
                await asyncio.wait_for(changed.wait(), min(remaining, self.config.metrics_stale_s))
            except TimeoutError:
                pass

    def release(self, slot: Slot) -> None:
        if slot.released:
            return
        slot.released = True
        self.pacer(slot.server).finish(slot)
        self._notify()

    def first_token(self, slot: Slot, ttft_s: float) -> None:
        pacer = self.pacer(slot.server)
        before = pacer.aimd.limit
        pacer.aimd.first_token(ttft_s, slot.started_at, slot.at_limit)
        if pacer.aimd.limit > before:
            self._notify()

    def overloaded(self, slot: Slot) -> None:
        """The server answered 429 or 503: it has more than it can take."""
        self.pacer(slot.server).aimd.cut(slot.started_at)

    def observe_load(self, server: Hashable, load: ServerLoad | None) -> None:
        self.pacer(server).observe_load(load)
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def state(self) -> dict[Hashable, dict[str, object]]:
        return {server: {"in_flight": p.in_flight, "limit": p.limit(), "mode": p.mode}
                for server, p in self._pacers.items()}
