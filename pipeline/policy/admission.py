"""The gateway's admission decision, composed from the single-concern policies. Pure, no I/O.

For each request, in order (the first that says no decides; nothing is charged for a request
that is not admitted):

1. validation                          → REJECTED invalid_request
   the model: one no pool serves (the model catalog, once it knows)
                                       → REJECTED model_not_found; none named → the default
2. already cancelled                   → CANCELLED
3. deadline passed (the client's timeout, capped at the server's max)
                                       → EXPIRED
4. effective priority (tier, urgency, and load for tenants holding much of the band's queue)
5. fairness: the tenant's outstanding cap in that band; demote down to the floor
                                       → REJECTED quota_exceeded + retry_after_ms
6. bounded queue of the band           → REJECTED queue_full + retry_after_ms (drain rate)
7. deadline cannot be met even at the fastest wait recent evidence allows
                                       → EXPIRED
8. degradation: under load, a simple request that allows it gets the smaller model
9. rate limits, every bucket, requests and tokens (of the model it will run on); over a "delay"
   limit it is shaped: admitted to start once the bucket has room (``not_before_ms``), unless
   that is past its deadline or the longest delay
                                       → REJECTED rate_limited + which limit + retry_after_ms
10. admitted: dispatched to its band with position and ETA; charged to the tenant's buckets,
    counted in its outstanding requests and in the band's queue.

The tenant's state is one :class:`~pipeline.policy.state.TenantState`, changed in place on
admission. Duplicate request ids are the caller's concern.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

from pipeline.catalog.catalog import ModelCatalog
from pipeline.models import Priority, Request
from pipeline.policy import ratelimit
from pipeline.policy.fairness import FairnessQuotas
from pipeline.policy.priority import PriorityPolicy, effective_priority
from pipeline.policy.queues import QueueModel
from pipeline.policy.ratelimit import RateLimit
from pipeline.policy.state import TenantState
from pipeline.policy.tokens import estimate_tokens
from pipeline.policy.validation import validate_request

_UNKNOWN = float("inf")


class Action(enum.Enum):
    DISPATCH = "dispatch"
    REJECT = "reject"
    EXPIRE = "expire"
    CANCEL = "cancel"


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
    #: The token estimate charged to the buckets (prompt estimate + max_tokens), settled later.
    charged_tokens: int = 0
    #: Shaped by a rate limit: epoch ms before which it must not start (0: at once).
    not_before_ms: int = 0


@dataclass(frozen=True)
class DegradePolicy:
    load: float = 0.8
    downgrade: dict[str, str] | None = None
    simple_prompt_tokens: int = 1_000
    simple_max_tokens: int = 512


@dataclass(frozen=True)
class RateLimits:
    """The limits of every tenant: its own in the config, else its registry record's
    (``lookup(tenant)``: a list, or None for none of its own), else ``default``."""

    default: list[RateLimit] = field(default_factory=list)
    per_tenant: dict[str, list[RateLimit]] = field(default_factory=dict)
    lookup: Callable[[str], Sequence[RateLimit] | None] | None = None

    def of(self, tenant: str) -> list[RateLimit]:
        own = self.per_tenant.get(tenant)
        if own is not None:
            return own
        if self.lookup is not None:
            registered = self.lookup(tenant)
            if registered is not None:
                return list(registered)
        return self.default


class Admission:
    def __init__(self, priority: PriorityPolicy, limits: RateLimits, quotas: FairnessQuotas, queues: QueueModel,
                 degrade: DegradePolicy, *, max_timeout_ms: int = 600_000, topics_prefix: str | None = None,
                 early_expiry: bool = True, max_delay_ms: int = 30_000, reorder_ms: int = 10_000,
                 models: Callable[[], ModelCatalog] | None = None):
        self.priority = priority
        #: The model catalog's current snapshot (None: no model is refused, none named stays so).
        self.models = models
        #: A request read at most this long after a later arrival of its tenant is judged at its own
        #: arrival (the limits hold exactly over intervals of arrivals); an older one at the buckets'
        #: clock, so that a long backlog is not refused for charges made after it arrived.
        self.reorder_ms = reorder_ms
        self.limits = limits
        self.quotas = quotas
        self.queues = queues
        self.degrade = degrade
        self.max_timeout_ms = max_timeout_ms
        self.early_expiry = early_expiry
        #: The longest a request over a "delay" rate limit is held back.
        self.max_delay_ms = max_delay_ms
        #: Where a request's reply_to may point (under the pipeline's topic prefix).
        self.topics_prefix = topics_prefix

    def deadline_ms(self, req: Request) -> int:
        return req.created_at + min(req.timeout_ms, self.max_timeout_ms)

    def decide(self, req: Request, now_ms: int, state: TenantState, *, cancelled: bool = False,
               arrived_ms: int | None = None) -> Decision:
        """``arrived_ms``: when the request reached Kafka (its record's timestamp), the clock of the
        token buckets (a refusal's retry-after counts from the latest arrival they were charged at:
        TenantState.bucket_time);
        a gateway that falls behind then neither squeezes a backlog through one burst nor lets it
        through late. Deadlines run on ``now_ms``."""
        problem = validate_request(req, now_ms, self.topics_prefix)
        if problem is not None:
            return Decision(Action.REJECT, problem)
        model = req.model
        if self.models is not None:
            catalog = self.models()
            model = model or catalog.default(now_ms)
            problem = catalog.refusal(model, now_ms)
            if problem is not None:
                return Decision(Action.REJECT, problem)
        if cancelled:
            return Decision(Action.CANCEL, "cancelled: cancelled by the client before dispatch")
        left = self.deadline_ms(req) - now_ms
        if left <= 0:
            return Decision(Action.EXPIRE, f"expired: deadline passed {-left} ms before admission")

        queues, quotas, tenant = self.queues, self.quotas, req.tenant_id
        asked = req.priority.rank
        load = queues.load(asked, now_ms)
        eta = queues.eta_ms(asked, now_ms, tenant)
        # The tenant's requests admitted and unfinished in the band, against what the band holds.
        share = state.outstanding[asked] / max(1, queues.depth[asked])
        wanted = effective_priority(req.priority, req.user_tier, left, eta if eta < _UNKNOWN else 0.0, load,
                                    self.priority, share)
        notes = wanted.reasons
        effective = wanted.effective
        placement = quotas.place(tenant, effective, state.outstanding)
        band = placement.band
        if band is None:
            # Room comes back as the tenant's requests finish: about the band's ETA.
            verdict = queues.check(effective.rank, now_ms=now_ms, tenant=tenant)
            retry = max(verdict.retry_after_ms, int(min(verdict.eta_ms, 60_000)), 100)
            return Decision(Action.REJECT, f"quota_exceeded: tenant has {quotas.cap(tenant, effective)} requests "
                                           f"outstanding in {effective.value} and every band down to "
                                           f"{quotas.floor.value}", retry_after_ms=retry, band=effective)
        if placement.demoted_from is not None:
            notes += (f"quota: demoted from {placement.demoted_from.value}",)
        verdict = queues.check(band.rank, now_ms=now_ms, tenant=tenant)
        if verdict.full:
            return Decision(Action.REJECT, f"queue_full: band {band.value} holds {queues.depth[band.rank]} requests "
                                           f"(cap {queues.caps[band.rank]})",
                            retry_after_ms=verdict.retry_after_ms, band=band, position=verdict.position)
        # Only on evidence: the wait even at the fastest recent drain (0 when the evidence is thin
        # or old). Otherwise the request is admitted, and a worker expires it if its deadline
        # passes before it starts.
        if self.early_expiry and left < verdict.eta_floor_ms:
            return Decision(Action.EXPIRE, f"expired: deadline cannot be met (queue wait at least "
                                           f"{verdict.eta_floor_ms:.0f} ms, {left} ms left)", band=band)

        degraded_from = None
        d = self.degrade
        prompt_tokens = estimate_tokens(req.prompt)
        if (d.downgrade and req.allow_degrade and load >= d.load and model in d.downgrade
                and prompt_tokens <= d.simple_prompt_tokens and req.max_tokens <= d.simple_max_tokens):
            model, degraded_from = d.downgrade[model], model
            notes += (f"degraded {degraded_from} -> {model} at load {load:.0%}",)

        charged = prompt_tokens + req.max_tokens
        # Judged at its own arrival, so that the limit holds over intervals of arrivals however the
        # five band topics are read (ratelimit.admit), unless it is older than the reorder window
        # (self.reorder_ms); a refusal's retry-after runs from the buckets' clock.
        arrived = now_ms if arrived_ms is None else arrived_ms
        clock = state.bucket_time(arrived)
        at = arrived if clock - arrived <= self.reorder_ms else clock
        # Held back no longer than its deadline allows (counted from its arrival), nor than the
        # longest delay.
        max_delay = max(0, min(self.max_delay_ms, left - (now_ms - at)))
        limited = ratelimit.admit(state.buckets, self.limits.of(tenant), model, charged, at, max_delay,
                                  clock_ms=clock)
        if not limited.admitted:
            return Decision(Action.REJECT, f"rate_limited: limit {limited.limit}: {limited.detail}",
                            retry_after_ms=limited.retry_after_ms or None, band=band)
        not_before, eta = 0, verdict.eta_ms
        if limited.delay_ms:
            not_before = int(at + limited.delay_ms + 0.999)
            eta = max(eta, not_before - now_ms)
            notes += (f"shaped: starts in {max(0, not_before - now_ms)} ms, at its rate limits' pace",)

        state.charged_at(at)
        state.admitted(band.rank)
        queues.admitted(band.rank, tenant, req.request_id, now_ms)
        return Decision(Action.DISPATCH, band=band, model=model, degraded_from=degraded_from,
                        position=verdict.position, eta_ms=eta, notes=notes, charged_tokens=charged,
                        not_before_ms=not_before if not_before > now_ms else 0)

    def admitted_again(self, tenant: str, state: TenantState, band: Priority, model: str, charged_tokens: int,
                       arrived_ms: int) -> None:
        """The effect of an admission decided before, applied to a state that does not hold it yet
        (the state is written less often than decisions are recorded): charged and counted as then."""
        ratelimit.charge(state.buckets, self.limits.of(tenant), model, charged_tokens, arrived_ms)
        state.charged_at(arrived_ms)
        state.admitted(band.rank)

    def finished(self, tenant: str, state: TenantState, band: Priority, model: str | None, charged_tokens: int,
                 used_tokens: int | None, now_ms: int) -> None:
        """A dispatched request reached its terminal response: one fewer outstanding, and the
        token buckets corrected by what it really used (when the answer says)."""
        state.finished(band.rank)
        if used_tokens is not None and charged_tokens and model is not None:
            ratelimit.settle(state.buckets, self.limits.of(tenant), model, used_tokens - charged_tokens, now_ms)
