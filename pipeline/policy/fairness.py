"""Fairness quotas between tenants: caps on outstanding requests per tenant and band. Pure.

A tenant over its cap in the band it was given is first demoted to the next lower band (the
seed's "try the alternative queue"), down to a configured floor; with no band left the request
is refused ``quota_exceeded``. Outstanding counts go up on admission and down when the
request's terminal response is seen, so they stay right across gateway restarts when kept in a
changelog-backed table (``counts`` is any mutable mapping).
"""

from __future__ import annotations

from typing import MutableMapping, NamedTuple

from pipeline.models import Priority

_BANDS = tuple(Priority)


class Placement(NamedTuple):
    band: Priority | None  # None: no band has room under the tenant's caps
    demoted_from: Priority | None = None


_NOWHERE = Placement(None)
_STAY = {b: Placement(b) for b in _BANDS}
_KEY_SUFFIX = {b: f"\x1f{b.value}" for b in _BANDS}


def outstanding_key(tenant: str, band: Priority) -> str:
    return tenant + _KEY_SUFFIX[band]


class FairnessQuotas:
    def __init__(self, caps: dict[str, int], *, floor: Priority = Priority.BACKGROUND,
                 tenant_caps: dict[str, dict[str, int]] | None = None,
                 counts: MutableMapping[str, int] | None = None):
        """``caps``: band name → most requests one tenant may have outstanding there (0 = no cap)."""
        self.caps = dict(caps)
        self._band_caps = [int(self.caps.get(b.value, 0)) for b in _BANDS]
        self.floor = floor
        self.tenant_caps = dict(tenant_caps or {})
        self.counts: MutableMapping[str, int] = {} if counts is None else counts
        # A counting mapping (the gateway's table view) adds in one step: one read, not two.
        self._add = getattr(self.counts, "add", None)

    def cap(self, tenant: str, band: Priority) -> int:
        own = self.tenant_caps.get(tenant)
        if own is not None and band.value in own:
            return int(own[band.value])
        return int(self.caps.get(band.value, 0))

    def outstanding(self, tenant: str, band: Priority) -> int:
        return self.counts.get(outstanding_key(tenant, band), 0)

    def place(self, tenant: str, band: Priority) -> Placement:
        """The band ``tenant``'s request goes to: ``band`` if under the cap, else the next lower
        one with room, no lower than the floor (nor below ``band`` if it is already below it)."""
        floor = max(self.floor.rank, band.rank)
        own = self.tenant_caps.get(tenant)
        band_caps, counts = self._band_caps, self.counts
        for rank in range(band.rank, floor + 1):
            b = _BANDS[rank]
            cap = band_caps[rank] if own is None else self.cap(tenant, b)
            if not cap or counts.get(outstanding_key(tenant, b), 0) < cap:
                return _STAY[b] if b is band else Placement(b, band)
        return _NOWHERE

    def admitted(self, tenant: str, band: Priority) -> None:
        key = outstanding_key(tenant, band)
        if self._add is not None:
            self._add(key)
        else:
            self.counts[key] = self.counts.get(key, 0) + 1

    def finished(self, tenant: str, band: Priority) -> None:
        key = outstanding_key(tenant, band)
        left = self.counts.get(key, 0) - 1
        if left > 0:
            self.counts[key] = left
        elif key in self.counts:
            del self.counts[key]
