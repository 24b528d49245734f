"""The gateway's admission decision, composed from the single-concern policies. Pure, no I/O.

For each request, in order (the first that says no decides; nothing is counted for a request
that is not admitted):

1. validation                          → REJECTED invalid_request
2. already cancelled                   → CANCELLED
3. deadline passed (the client's timeout, capped at the server's max)
                                       → EXPIRED
4. effective priority (tier, urgency, load)
5. fairness: the tenant's outstanding cap in that band; demote down to the floor
                                       → REJECTED quota_exceeded + retry_after_ms
6. bounded queue of the band           → REJECTED queue_full + retry_after_ms (drain rate)
7. deadline cannot be met at the band's current ETA
                                       → EXPIRED
8. rate limits, every window, requests and tokens
                                       → REJECTED rate_limited + which limit + retry_after_ms
9. degradation: under load, a simple request that allows it gets the smaller model
10. admitted: dispatched to its band with position and ETA; counted in the limits, the
    tenant's outstanding and the band's depth.

Duplicate request ids are the caller's concern (it must answer an id once, across restarts).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from pipeline.models import Priority, Request
from pipeline.policy.fairness import FairnessQuotas
from pipeline.policy.priority import PriorityPolicy, effective_priority
from pipeline.policy.queues import QueueModel
from pipeline.policy.ratelimit import RateLimiter
from pipeline.policy.validation import validate_request


_UNKNOWN = float("inf")


class Action(enum.Enum):
    DISPATCH = "dispatch"
    REJECT = "reject"
    EXPIRE = "expire"
    CANCEL = "cancel"


_DISPATCH = Action.DISPATCH  # an enum member read from its class costs a lookup every time
_new = tuple.__new__  # a NamedTuple built from a tuple: its keyword-parsing __new__ costs ~0.7 us


class Decision(NamedTuple):
    action: Action
    reason: str | None = None
    retry_after_ms: int | None = None
    band: Priority | None = None
    model: str | None = None
    degraded_from: str | None = None
    position: int | None = None
    eta_ms: float | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class DegradePolicy:
    load: float = 0.8
    downgrade: dict[str, str] | None = None
    simple_prompt_tokens: int = 1_000
    simple_max_tokens: int = 512


def estimate_prompt_tokens(prompt: str) -> int:
    """≈4 characters per token (English BPE); the same estimate the workers report."""
    return max(1, (len(prompt) + 3) // 4)


class Admission:
    def __init__(self, priority: PriorityPolicy, limiter: RateLimiter, quotas: FairnessQuotas, queues: QueueModel,
                 degrade: DegradePolicy, *, max_timeout_ms: int = 600_000):
        self.priority = priority
        self.limiter = limiter
        self.quotas = quotas
        self.queues = queues
        self.degrade = degrade
        self.max_timeout_ms = max_timeout_ms

    def deadline_ms(self, req: Request) -> int:
        return req.created_at + min(req.timeout_ms, self.max_timeout_ms)

    def decide(self, req: Request, now_ms: int, *, cancelled: bool = False) -> Decision:
        # Run for every request the gateway reads: attributes are read once into locals, and
        # the common answers built without the keyword parsing of their NamedTuples.
        problem = validate_request(req, now_ms)
        if problem is not None:
            return Decision(Action.REJECT, problem)
        if cancelled:
            return Decision(Action.CANCEL, "cancelled: cancelled by the client before dispatch")
        timeout = req.timeout_ms
        max_timeout = self.max_timeout_ms
        left = req.created_at + (timeout if timeout < max_timeout else max_timeout) - now_ms
        if left <= 0:
            return Decision(Action.EXPIRE, f"expired: deadline passed {-left} ms before admission")

        queues = self.queues
        quotas = self.quotas
        tenant = req.tenant_id
        requested = req.priority
        rate, load = queues.outlook(now_ms)
        eta = queues.eta_ms(requested.rank, now_ms, rate)
        wanted = effective_priority(requested, req.user_tier, left, eta if eta < _UNKNOWN else 0.0, load,
                                    self.priority)
        notes = wanted.reasons
        effective = wanted.effective
        placement = quotas.place(tenant, effective)
        band = placement.band
        if band is None:
            verdict = queues.check(effective.rank, now_ms, rate)
            # Room comes back as the tenant's requests finish: about the band's ETA.
            retry = max(verdict.retry_after_ms, int(min(verdict.eta_ms, 60_000)), 100)
            cap = quotas.cap(tenant, effective)
            return Decision(Action.REJECT, f"quota_exceeded: tenant has {cap} requests outstanding in "
                                           f"{effective.value} and every band down to {quotas.floor.value}",
                            retry_after_ms=retry, band=effective)
        if placement.demoted_from is not None:
            notes += (f"quota: demoted from {placement.demoted_from.value}",)
        rank = band.rank
        verdict = queues.check(rank, now_ms, rate)
        full, position, band_eta, _ = verdict
        if full:
            return Decision(Action.REJECT, f"queue_full: band {band.value} holds {queues.depth[rank]} requests "
                                           f"(cap {queues.caps[rank]})",
                            retry_after_ms=verdict.retry_after_ms, band=band, position=position)
        # An unknown ETA (nothing has drained yet) is no reason to give up on a request.
        if left < band_eta < _UNKNOWN:
            return Decision(Action.EXPIRE, f"expired: deadline cannot be met (queue ETA {band_eta:.0f} ms, "
                                           f"{left} ms left)", band=band)

        model, degraded_from = req.model, None
        d = self.degrade
        prompt_tokens = estimate_prompt_tokens(req.prompt)
        if (d.downgrade and req.allow_degrade and load >= d.load and model in d.downgrade
                and prompt_tokens <= d.simple_prompt_tokens and req.max_tokens <= d.simple_max_tokens):
            model, degraded_from = d.downgrade[model], model
            notes += (f"degraded {degraded_from} -> {model} at load {load:.0%}",)

        limited = self.limiter.admit(tenant, model, prompt_tokens + req.max_tokens, now_ms)
        if not limited.admitted:
            return Decision(Action.REJECT, f"rate_limited: limit {limited.limit}: {limited.detail}",
                            retry_after_ms=limited.retry_after_ms or None, band=band)

        quotas.admitted(tenant, band)
        queues.admitted(rank, now_ms)
        # Decision(_DISPATCH, band=, model=, degraded_from=, position=, eta_ms=, notes=)
        return _new(Decision, (_DISPATCH, None, None, band, model, degraded_from, position, band_eta, notes))

    def finished(self, tenant: str, band: Priority, now_ms: int) -> None:
        """A dispatched request reached its terminal response."""
        self.quotas.finished(tenant, band)
        self.queues.finished(band.rank, now_ms)
