"""How evenly the gateway shares admission between tenants: Jain's fairness index over a window. Pure, no I/O.

Definition, per band (the priority a request asked for) and over the last ``window_s`` seconds:

* a tenant's *demand* ``r_i`` is the number of its requests the admission policy decided on in that
  band: admitted, or refused for capacity or policy (``rate_limited``, ``quota_exceeded``,
  ``queue_full``, ...). A request refused as ``invalid_request`` asked for nothing the tenant could
  have been given, so it is no demand; expirations, cancellations and duplicates are not decisions
  about capacity and are not counted either (the caller does not report them);
* its *share* is ``x_i = a_i / r_i``, ``a_i`` of those admitted, so ``0 <= x_i <= 1``;
* over the ``n`` tenants with demand, ``J = (sum x_i)^2 / (n * sum x_i^2)``.

``J`` is 1 when every tenant got the same share of what it asked for (all of it, or the same
fraction of it), and ``k/n`` when ``k`` tenants got everything and the others nothing, down to
``1/n``. A shortage spread evenly (everyone at 50 %) still reads 1: the index says whether the
gateway is *even-handed*, not whether it admits enough (``llmq_requests_total{outcome="admitted"}``
and the LlmqGatewayNotAdmitting alert say that). When nothing at all was admitted every share is 0,
equal again, and the index is 1. With no demand in the window there is no index (``None``).

Shares are normalised by demand, not by a contract: a tenant given smaller limits on purpose
(``gateway.tenant_limits``) lowers the index when it asks for more than those limits allow. Read a
low index together with the rejections by reason.

The window is a ring of ``slots`` slots of ``window_s / slots`` seconds each: an observation lands
in the current slot and leaves with it, so the index covers between ``window_s - window_s/slots``
and ``window_s`` seconds. The sums behind ``J`` are kept up to date per observation, O(1), because
the gateway reports every decision from its event loop; they are recomputed exactly from the
per-tenant totals whenever a slot expires, so float rounding cannot build up.
"""

from __future__ import annotations

import math

#: Refusal reason codes that are not demand the gateway could have served.
NOT_DEMAND = frozenset({"invalid_request"})


def jain(shares) -> float | None:
    """Jain's index of ``shares`` (each >= 0); ``None`` for no shares, 1.0 when all are 0."""
    n = total = squares = 0
    for x in shares:
        n += 1
        total += x
        squares += x * x
    if n == 0:
        return None
    return _index(n, total, squares)


def _index(n: int, total: float, squares: float) -> float:
    if squares <= 1e-12:  # every share 0: all equally refused
        return 1.0
    return min(1.0, max(1.0 / n, total * total / (n * squares)))


class FairnessWindow:
    """Per-tenant admitted/demand counts of one band over a sliding window, and their Jain index."""

    def __init__(self, window_s: float = 60.0, slots: int = 12):
        if window_s <= 0 or slots < 1:
            raise ValueError("window_s must be > 0 and slots >= 1")
        self.window_s = float(window_s)
        self.slot_s = self.window_s / slots
        self._slots: list[dict[str, list[int]]] = [{} for _ in range(slots)]
        self._slot: int | None = None  # the number (time // slot_s) of the current slot
        self._current = self._slots[0]
        #: tenant -> [admitted, demand] over the whole window
        self._totals: dict[str, list[int]] = {}
        self._sum = 0.0
        self._squares = 0.0

    @property
    def tenants(self) -> int:
        """Tenants with demand in the window."""
        return len(self._totals)

    def observe(self, tenant: str, admitted: bool) -> None:
        """One decision on ``tenant``'s request, counted in the current slot."""
        slot = self._current.get(tenant)
        if slot is None:
            slot = self._current[tenant] = [0, 0]
        total = self._totals.get(tenant)
        if total is None:
            total = self._totals[tenant] = [0, 0]
            old = None
        else:
            old = total[0] / total[1]
        slot[1] += 1
        total[1] += 1
        if admitted:
            slot[0] += 1
            total[0] += 1
        new = total[0] / total[1]
        if old is None:
            self._sum += new
            self._squares += new * new
        elif new != old:
            self._sum += new - old
            self._squares += new * new - old * old

    def advance(self, now_s: float) -> None:
        """Move the window to ``now_s`` (a monotonic clock, seconds): slots older than the window go."""
        number = math.floor(now_s / self.slot_s)
        if self._slot is None:
            self._slot = number
            self._current = self._slots[number % len(self._slots)]
            return
        if number <= self._slot:
            return  # same slot (or a clock that went back: keep counting where we are)
        ring = len(self._slots)
        expired = False
        for n in range(self._slot + 1, min(number, self._slot + ring) + 1):
            slot = self._slots[n % ring]
            if slot:
                self._expire(slot)
                expired = True
        self._slot = number
        self._current = self._slots[number % ring]
        if expired:
            self._recompute()

    def index(self) -> float | None:
        """Jain's index of the tenants' admitted/demand shares in the window (``None``: no demand)."""
        n = len(self._totals)
        if n == 0:
            return None
        return _index(n, self._sum, self._squares)

    def shares(self) -> dict[str, float]:
        """Each tenant's admitted/demand share in the window."""
        return {t: a / r for t, (a, r) in self._totals.items()}

    def _expire(self, slot: dict[str, list[int]]) -> None:
        totals = self._totals
        for tenant, (admitted, demand) in slot.items():
            total = totals[tenant]
            total[0] -= admitted
            total[1] -= demand
            if total[1] <= 0:
                del totals[tenant]
        slot.clear()

    def _recompute(self) -> None:
        total = squares = 0.0
        for a, r in self._totals.values():
            x = a / r
            total += x
            squares += x * x
        self._sum, self._squares = total, squares
