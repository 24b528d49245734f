"""Fairness quotas between tenants: caps on outstanding requests per tenant and band. Pure.

A tenant over its cap in the band it was given is first demoted to the next lower band (the
seed's "try the alternative queue"), down to a configured floor; with no band left the request
is refused ``quota_exceeded``. A tenant's outstanding counts (one per band) go up on admission
and down when the request's terminal response is seen; they live in the tenant's state record
(:class:`pipeline.policy.state.TenantState`), so they survive restarts with it.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

from pipeline.models import BANDS, Priority


class Placement(NamedTuple):
    band: Priority | None  # None: no band has room under the tenant's caps
    demoted_from: Priority | None = None


_NOWHERE = Placement(None)


class FairnessQuotas:
    def __init__(self, caps: dict[str, int], *, floor: Priority = Priority.BACKGROUND,
                 tenant_caps: dict[str, dict[str, int]] | None = None,
                 lookup: Callable[[str], Mapping[str, int] | None] | None = None):
        """``caps``: band name → most requests one tenant may have outstanding there (0 = no cap);
        ``tenant_caps`` (config) and then ``lookup(tenant)`` (the registry) replace it band by band."""
        self.caps = dict(caps)
        self.floor = floor
        self.tenant_caps = {t: dict(c) for t, c in (tenant_caps or {}).items()}
        self.lookup = lookup

    def cap(self, tenant: str, band: Priority) -> int:
        own = self.tenant_caps.get(tenant)
        if own is not None and band.value in own:
            return int(own[band.value])
        if self.lookup is not None:
            registered = self.lookup(tenant)
            if registered and band.value in registered:
                return int(registered[band.value])
        return int(self.caps.get(band.value, 0))

    def place(self, tenant: str, band: Priority, outstanding: Sequence[int]) -> Placement:
        """The band ``tenant``'s request goes to: ``band`` if under the cap, else the next lower
        one with room, no lower than the floor (nor below ``band`` if it is already below it)."""
        floor = max(self.floor.rank, band.rank)
        for rank in range(band.rank, floor + 1):
            b = BANDS[rank]
            cap = self.cap(tenant, b)
            if not cap or outstanding[rank] < cap:
                return Placement(b) if b is band else Placement(b, band)
        return _NOWHERE
