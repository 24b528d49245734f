"""How fairly a worker's band slots went to the tenants who waited for them: share ratios and Jain's index. Pure.

A tenant's *entitled* tokens are what weighted fair sharing would have given it: in each tick
(a second), the tokens served to the tenants that had requests waiting, split between those
tenants by weight. Its *share ratio* is what it was served over what it was entitled to, over
the last window (a minute): 1 is its fair share, 0.5 half of it. Tenants that waited for
nothing are left out: a tenant asking for less than its share is not treated unfairly.

Jain's index over the waiting tenants' share ratios, (Σx)² / (n·Σx²), is 1 when every one got
its weighted share and 1/n when one of n got everything.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Mapping

from pipeline.observability.fairness import jain


class FairShareWindow:
    def __init__(self, ticks: int = 60):
        self._ticks: deque[dict] = deque(maxlen=ticks)  # each: tenant → (served, entitled)
        self._served: dict[Hashable, float] = {}  # this tick

    def served(self, tenant: Hashable, tokens: float) -> None:
        self._served[tenant] = self._served.get(tenant, 0.0) + tokens

    def tick(self, waiting: Mapping[Hashable, float]) -> None:
        """Close the tick: ``waiting`` (tenant → weight) are the tenants with requests waiting."""
        served, self._served = self._served, {}
        total = sum(served.get(t, 0.0) for t in waiting)
        weights = sum(waiting.values())
        if total <= 0 or weights <= 0:
            self._ticks.append({})
            return
        self._ticks.append({t: (served.get(t, 0.0), total * w / weights) for t, w in waiting.items()})

    def ratios(self) -> dict[Hashable, float]:
        """Each tenant that waited in the window: served / entitled."""
        served: dict[Hashable, float] = {}
        entitled: dict[Hashable, float] = {}
        for tick in self._ticks:
            for tenant, (s, e) in tick.items():
                served[tenant] = served.get(tenant, 0.0) + s
                entitled[tenant] = entitled.get(tenant, 0.0) + e
        return {t: served[t] / e for t, e in entitled.items() if e > 0}

    def jain(self) -> float | None:
        """Jain's index over :meth:`ratios` (None with fewer than two tenants waiting)."""
        ratios = list(self.ratios().values())
        return jain(ratios) if len(ratios) >= 2 else None
