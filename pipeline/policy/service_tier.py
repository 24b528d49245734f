"""OpenAI's ``service_tier`` as llmq bands, and the tier a band served. Pure, no I/O.

| asked               | band                                                         |
|---------------------|--------------------------------------------------------------|
| ``auto``, ``default``, none | the base band (NORMAL, or LOW in background), capped by the tenant |
| ``flex``            | one band below the base (BACKGROUND stays BACKGROUND)        |
| ``priority``        | one band above the base, within the tenant's max_priority    |

The answer's ``service_tier`` is read from the band the request was written in, against the base:
below it ``flex``, above it ``priority``, else ``default`` (a flex request in its own band is
``flex`` even when the base was already the lowest). A priority request the tenant may not raise
is served, and answered, ``default``. The gateway's tier offsets (an enterprise tenant's bands one
up) move every band of a tenant alike, so they change no tier.
"""

from __future__ import annotations

from typing import Callable

from pipeline.models import BANDS, Priority

TIERS = ("auto", "default", "flex", "priority")


def _shift(band: Priority, by: int) -> Priority:
    return BANDS[min(len(BANDS) - 1, max(0, band.rank + by))]


def band_for(tier: str | None, base: Priority, cap: Callable[[Priority], Priority]) -> tuple[Priority, Priority]:
    """(the band to ask for, the base band it is compared with), ``cap`` the tenant's limit."""
    base = cap(base)
    if tier == "flex":
        return _shift(base, +1), base
    if tier == "priority":
        return cap(_shift(base, -1)), base
    return base, base


def served_tier(asked: str | None, base: Priority, served: Priority | None) -> str:
    """The tier to answer: what the band the request ran in (None: the asked tier's) says."""
    band = served or band_for(asked, base, lambda p: p)[0]
    if band.rank > base.rank or (asked == "flex" and band.rank == _shift(base, +1).rank):
        return "flex"
    if band.rank < base.rank:
        return "priority"
    return "default"
