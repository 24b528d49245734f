"""Effective priority: which band an admitted request is dispatched to. Pure, no I/O.

The seed's SLA rule, generalised: start from the requested band, move by the tenant tier's
offset, move up one band when the deadline is urgent, move non-critical work down one band
under high load, and clamp to the five bands. Every move is reported, so a response can say
why it was served where it was.

Load moves down only the work of tenants that make it: a tenant holding less than
``load_spared_share`` of the band's queue keeps its band. Moving everyone would put a quiet
tenant's requests into the band below, where they wait behind whatever the flooding tenant still
has in the band above: the demotion meant to relieve the band would punish the tenant who did
not load it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pipeline.models import Priority

_BANDS = tuple(Priority)
_N = len(_BANDS)
_CRITICAL = Priority.CRITICAL  # an enum member read from its class costs a lookup every time


@dataclass(frozen=True)
class PriorityPolicy:
    #: Band offset per user tier: negative moves up (toward CRITICAL), positive moves down.
    tier_offsets: dict[str, int] = field(default_factory=lambda: {"enterprise": -1, "standard": 0, "free": 1})
    #: A request is urgent when the time left before its deadline is below this many ms, or
    #: below ``urgent_eta_factor`` × the band's current ETA.
    urgent_ms: int = 2_000
    urgent_eta_factor: float = 2.0
    #: Load (0..1 of measured capacity) above which non-critical requests move down one band.
    high_load: float = 0.8
    #: Under high load, a tenant holding less than this share of the band's queue keeps its band.
    load_spared_share: float = 0.1
    #: Requests are never moved above this band by tier or urgency (only asked-for CRITICAL is CRITICAL).
    highest_promoted: Priority = Priority.HIGH


class PriorityDecision(NamedTuple):
    requested: Priority
    effective: Priority
    reasons: tuple[str, ...]


# Most decisions move nothing: one shared answer per band.
_UNMOVED = tuple(PriorityDecision(b, b, ()) for b in _BANDS)


def effective_priority(requested: Priority, user_tier: str, time_left_ms: int, eta_ms: float, load: float,
                       policy: PriorityPolicy, queue_share: float = 1.0) -> PriorityDecision:
    """The band to dispatch to, and why it differs from ``requested`` (if it does).
    ``queue_share``: the part of the requested band's queue that is the tenant's own (0..1)."""
    rank = requested.rank
    reasons = ()
    offset = policy.tier_offsets.get(user_tier, 0)
    if offset:
        rank += offset
        reasons += (f"tier {user_tier} {'+' if offset < 0 else '-'}{abs(offset)}",)
    if time_left_ms < policy.urgent_ms or time_left_ms < policy.urgent_eta_factor * eta_ms:
        rank -= 1
        reasons += ("deadline urgent +1",)
    ceiling = 0 if requested is _CRITICAL else policy.highest_promoted.rank
    if rank < ceiling:
        rank = ceiling
    if load >= policy.high_load and requested is not _CRITICAL and rank > 0 and queue_share >= policy.load_spared_share:
        rank += 1
        reasons += (f"load {load:.0%} -1",)
    if not 0 <= rank < _N:
        rank = min(max(rank, 0), _N - 1)
    if not reasons and rank == requested.rank:
        return _UNMOVED[rank]
    return PriorityDecision(requested, _BANDS[rank], reasons)
