"""Who gets a band's next free model slot: weighted fair queuing between tenants, by tokens. Pure.

Virtual token counters (VTC, Sheng et al., "Fairness in Serving Large Language Models", OSDI
2024), kept the start-time fair queuing way:

* every tenant has a counter, the tokens it has been served divided by its weight;
* a free slot goes to the tenant with the lowest counter among those with a request ready;
  its counter moves on at once by the request's estimated cost (:func:`request_cost`), and
  :meth:`FairQueue.settle` corrects it by the difference once the model reports the real usage;
* a tenant that had nothing waiting starts again at the *virtual time* (the counter of the
  last tenant picked, which never moves back): it neither saved credit while idle nor pays
  for what it was served before everyone else caught up.

The bound (VTC's theorem 4.4, for counters charged on dispatch and settled on completion):
between two tenants that both have requests waiting over an interval, the weighted tokens
served differ by at most about twice the largest single request's cost plus what is in
flight, whatever the arrival pattern. Work-conserving: a slot is never left free while any
tenant has a request ready.

Inside a tenant the order is earliest deadline first, then arrival. A request may carry a
*not-before* time (the gateway shaped it under a rate limit instead of refusing it): it waits,
unseen by the choice, until that time.

One :class:`FairQueue` per band; the bands themselves are strict (pipeline/policy/bands.py).
It also counts what waits per partition, in requests and bytes, for the worker's flow control.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import count
from typing import Any, Callable, Hashable, Iterable

#: An output token costs this many input tokens (llm-d's flow control weighs them so: decoding a
#: token takes a model step, prefilling one takes a fraction of one).
OUTPUT_WEIGHT = 2.0

#: Counters of tenants with nothing waiting are forgotten past this many tenants (those at or
#: below the virtual time: forgetting them changes nothing).
_MAX_IDLE_TENANTS = 10_000


def request_cost(prompt_tokens: int, output_tokens: int) -> float:
    """A request's cost in input-token units: the tokens a tenant is charged for."""
    return prompt_tokens + OUTPUT_WEIGHT * output_tokens


@dataclass(slots=True, eq=False)
class Waiting:
    """One queued request, as the queue sees it (``item``: whatever the caller queues)."""
    item: Any
    tenant: Hashable
    partition: Hashable
    deadline_ms: float = 0.0
    cost: float = 1.0
    not_before_ms: float = 0.0
    nbytes: int = 0
    seq: int = -1
    charged: float = 0.0  # counter units charged when picked (given back by put_back)
    gone: bool = False  # removed; its heap entries are skipped
    is_ready: bool = False  # in its tenant's ready heap (else waiting for its not-before time)
    since_ms: float = 0.0  # when it was queued (a request put back keeps its first time)


class _Tenant:
    __slots__ = ("ready", "n", "counter", "version")

    def __init__(self, counter: float):
        self.ready: list = []  # heap of (deadline, seq, Waiting)
        self.n = 0  # live entries in ready
        self.counter = counter
        self.version = 0  # bumped whenever its entry in the pick heap goes stale


class FairQueue:
    def __init__(self, weight: Callable[[Hashable], float] | None = None):
        """``weight(tenant)``: its share against the others (> 0; default 1 each)."""
        self._weight = weight or (lambda _tenant: 1.0)
        self._tenants: dict[Hashable, _Tenant] = {}
        self._pick: list = []  # heap of (counter, seq of its head, version, tenant)
        self._later: list = []  # heap of (not_before, seq, Waiting)
        self._seq = count()
        self.vtime = 0.0
        self.size = 0  # queued, ready or not
        self.ready = 0  # queued and ready
        self._depth: dict[Hashable, int] = {}
        self._bytes: dict[Hashable, int] = {}
        self.bytes = 0
        self._last: Waiting | None = None

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    # -- what waits ------------------------------------------------------------------------

    def depth(self, partition: Hashable) -> int:
        return self._depth.get(partition, 0)

    def partition_bytes(self, partition: Hashable) -> int:
        return self._bytes.get(partition, 0)

    def counter(self, tenant: Hashable) -> float:
        t = self._tenants.get(tenant)
        return t.counter if t is not None else self.vtime

    def waiting_tenants(self) -> list:
        """The tenants with a request ready now."""
        return [name for name, t in self._tenants.items() if t.n]

    def has_ready(self, now_ms: float) -> bool:
        if self._later and self._later[0][0] <= now_ms:
            self._mature(now_ms)
        return self.ready > 0

    def next_ready_at(self) -> float | None:
        """When the earliest shaped request becomes ready (None: none waits for its time)."""
        while self._later and self._later[0][2].gone:
            heapq.heappop(self._later)
        return self._later[0][0] if self._later else None

    # -- in and out ------------------------------------------------------------------------

    def push(self, entry: Waiting, now_ms: float) -> int:
        """Queue ``entry``; returns its partition's depth."""
        entry.seq = next(self._seq)
        entry.gone = False
        self._count(entry, 1)
        self._last = entry
        if entry.not_before_ms > now_ms:
            heapq.heappush(self._later, (entry.not_before_ms, entry.seq, entry))
        else:
            self._make_ready(entry)
        return self._depth[entry.partition]

    def pop(self, now_ms: float) -> Waiting | None:
        """The next request to start, its tenant charged for it; None if none is ready."""
        entry = self.peek(now_ms)
        if entry is None:
            return None
        t = self._tenants[entry.tenant]
        heapq.heappop(t.ready)
        entry.is_ready = False
        t.n -= 1
        self.ready -= 1
        self._count(entry, -1)
        entry.gone = True
        if t.counter > self.vtime:
            self.vtime = t.counter
        entry.charged = entry.cost / self._weight_of(entry.tenant)
        t.counter += entry.charged
        heapq.heappop(self._pick)
        if t.n:
            self._repick(entry.tenant, t)
        return entry

    def peek(self, now_ms: float) -> Waiting | None:
        """The request :meth:`pop` would return, or None."""
        if self._later and self._later[0][0] <= now_ms:
            self._mature(now_ms)
        pick, tenants = self._pick, self._tenants
        while pick:
            _, _, version, name = pick[0]
            t = tenants.get(name)
            if t is None or version != t.version or not t.n:
                heapq.heappop(pick)
                continue
            ready = t.ready
            while ready[0][2].gone:
                heapq.heappop(ready)
            return ready[0][2]
        return None

    def put_back(self, entry: Waiting, refund: bool = True, behind: Hashable | None = None) -> None:
        """A picked request that did not run after all (no room on its model's servers, or
        preempted): back in its place, the charge for it given back (``refund``). ``behind``: a
        tenant it made way for, which must still go first; the charge is given back only down to
        that tenant's counter."""
        t = self._tenants.get(entry.tenant)
        if t is not None and entry.charged and refund:
            t.counter -= entry.charged
            if behind is not None:
                floor = self.counter(behind)
                if t.counter <= floor:
                    t.counter = floor + 1e-9 * max(1.0, abs(floor))
        entry.charged = 0.0
        entry.gone = False
        self._count(entry, 1)
        self._make_ready(entry)
        if t is not None and t.n > 1:
            self._repick(entry.tenant, t)  # its counter moved back

    def settle(self, tenant: Hashable, delta_cost: float) -> None:
        """The request's real cost differed from its estimate by ``delta_cost`` (real − estimated)."""
        t = self._tenants.get(tenant)
        if t is None or not delta_cost:
            return
        t.counter += delta_cost / self._weight_of(tenant)
        if t.n:
            self._repick(tenant, t)

    def remove_last(self) -> Waiting | None:
        """Take back the entry :meth:`push` just queued (the worker handling a message at once)."""
        entry, self._last = self._last, None
        if entry is None or entry.gone:
            return None
        self._remove(entry)
        return entry

    def drop(self, partitions: Iterable[Hashable]) -> int:
        """Forget everything queued for ``partitions``; returns how many requests."""
        partitions = set(partitions)
        dropped = 0
        for t in self._tenants.values():
            for _, _, entry in t.ready:
                if not entry.gone and entry.partition in partitions:
                    self._remove(entry)
                    dropped += 1
        for _, _, entry in self._later:
            if not entry.gone and entry.partition in partitions:
                self._remove(entry)
                dropped += 1
        return dropped

    def entries(self) -> list[Waiting]:
        """Everything queued, in no particular order."""
        out = [e for t in self._tenants.values() for _, _, e in t.ready if not e.gone]
        out += [e for _, _, e in self._later if not e.gone]
        return out

    # -- inside ----------------------------------------------------------------------------

    def _weight_of(self, tenant: Hashable) -> float:
        w = self._weight(tenant)
        return w if w and w > 0 else 1.0

    def _count(self, entry: Waiting, sign: int) -> None:
        p = entry.partition
        self.size += sign
        self._depth[p] = depth = self._depth.get(p, 0) + sign
        nbytes = sign * entry.nbytes
        self._bytes[p] = self._bytes.get(p, 0) + nbytes
        self.bytes += nbytes
        if not depth:
            del self._depth[p]
            del self._bytes[p]

    def _make_ready(self, entry: Waiting) -> None:
        t = self._tenants.get(entry.tenant)
        if t is None:
            if len(self._tenants) >= _MAX_IDLE_TENANTS:
                self._forget_idle()
            t = self._tenants[entry.tenant] = _Tenant(self.vtime)
        heapq.heappush(t.ready, (entry.deadline_ms, entry.seq, entry))
        entry.is_ready = True
        t.n += 1
        self.ready += 1
        if t.n == 1:
            if t.counter < self.vtime:
                t.counter = self.vtime  # back from idle: no credit saved
            self._repick(entry.tenant, t)

    def _repick(self, name: Hashable, t: _Tenant) -> None:
        t.version += 1
        heapq.heappush(self._pick, (t.counter, t.ready[0][1], t.version, name))

    def _mature(self, now_ms: float) -> None:
        later = self._later
        while later and later[0][0] <= now_ms:
            entry = heapq.heappop(later)[2]
            if not entry.gone:
                self._make_ready(entry)

    def _remove(self, entry: Waiting) -> None:
        entry.gone = True
        self._count(entry, -1)
        if entry.is_ready:
            entry.is_ready = False
            self._tenants[entry.tenant].n -= 1
            self.ready -= 1

    def _forget_idle(self) -> None:
        vtime = self.vtime
        for name in [n for n, t in self._tenants.items() if not t.n and t.counter <= vtime]:
            del self._tenants[name]
