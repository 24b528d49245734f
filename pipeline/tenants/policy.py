"""What a request may be, given its tenant's record: the pure decision the gateway and serve share.

``authorize(request, record, headers, now_ms, raw=..., secret=...)`` returns the request as it is
to be admitted and, if it may not be, the reason (the gateway answers it REJECTED with that
reason; ``llmq serve`` answers 401/403):

1. no record: refused ``unauthorized`` when ``[tenants] require_known``; otherwise served as an
   unknown tenant: tier ``default_tier`` ("standard"), asks capped at ``default_max_priority``,
   every model, the gateway's default limits and caps;
2. a disabled record: refused ``unauthorized``;
3. a record that requires signed requests: the ``llmq-signature`` header must hold the HMAC of
   the raw message value under the tenant's secret, and created_at must be within
   ``signature_max_age_ms`` of now; else refused ``unauthorized`` (a secret that cannot be
   resolved refuses too, never lets it through);
4. a model the record does not allow: refused ``forbidden``;
5. the tier is the record's (what the request says is ignored: any producer could claim
   ``enterprise``) and the priority asked for is capped at the record's ``max_priority``.

Nothing here reads a clock, a file or the network.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from pipeline.models import Priority, Request
from pipeline.tenants.record import TenantRecord
from pipeline.tenants.signing import find_header, verify


@dataclass(frozen=True)
class TenantPolicy:
    require_known: bool = False
    default_tier: str = "standard"
    default_max_priority: Priority = Priority.CRITICAL
    signature_max_age_ms: int = 300_000

    @classmethod
    def from_settings(cls, tenants) -> TenantPolicy:
        return cls(tenants.require_known, tenants.default_tier, Priority.parse(tenants.default_max_priority),
                   tenants.signature_max_age_ms)


class Authorization(NamedTuple):
    #: The request to admit: tier from the registry, priority capped (the input is not changed).
    request: Request
    #: None, or the reason to refuse it ("unauthorized: ..." / "forbidden: ...").
    problem: str | None
    #: The tenant's record, None for an unknown tenant (the gateway's defaults apply).
    record: TenantRecord | None = None
    #: What was changed, for logs and responses ("priority capped CRITICAL -> HIGH").
    notes: tuple[str, ...] = ()


def authorize(request: Request, record: TenantRecord | None, headers: Any, now_ms: int, *, raw: bytes = b"",
              secret: bytes | None = None, policy: TenantPolicy = TenantPolicy()) -> Authorization:
    """``headers``: the message's headers (pairs or a mapping); ``raw``: its value as read;
    ``secret``: the tenant's resolved signing secret (None when it has none or it cannot be
    resolved)."""
    tenant = request.tenant_id
    if record is None:
        if policy.require_known:
            return Authorization(request, f"unauthorized: tenant {tenant!r} is not registered")
        return _shaped(request, None, policy.default_tier, policy.default_max_priority)
    if not record.enabled:
        return Authorization(request, f"unauthorized: tenant {tenant!r} is disabled", record)
    if record.require_signature:
        problem = _signature_problem(request, headers, now_ms, raw, secret, policy)
        if problem is not None:
            return Authorization(request, problem, record)
    if not record.allows_model(request.model):
        return Authorization(request, f"forbidden: model {request.model!r} is not allowed for tenant {tenant!r} "
                                      f"(allowed: {', '.join(record.models)})", record)
    return _shaped(request, record, record.tier, record.max_priority)


def _shaped(request: Request, record: TenantRecord | None, tier: str, highest: Priority) -> Authorization:
    notes: tuple[str, ...] = ()
    changes: dict[str, Any] = {}
    if request.user_tier != tier:
        changes["user_tier"] = tier
        notes += (f"tier {tier} (the request said {request.user_tier!r})",)
    if request.priority.rank < highest.rank:
        changes["priority"] = highest
        notes += (f"priority capped {request.priority.value} -> {highest.value}",)
    return Authorization(replace(request, **changes) if changes else request, None, record, notes)


def _signature_problem(request: Request, headers: Any, now_ms: int, raw: bytes, secret: bytes | None,
                       policy: TenantPolicy) -> str | None:
    tenant = request.tenant_id
    header = find_header(headers)
    if header is None:
        return f"unauthorized: tenant {tenant!r} requires signed requests (no llmq-signature header)"
    if secret is None:
        # Fail closed: a secret that cannot be read must not make signatures optional.
        return f"unauthorized: the signing secret of tenant {tenant!r} is not available here"
    if not raw or not verify(secret, raw, header):
        return "unauthorized: bad llmq-signature (HMAC-SHA256 of the request bytes with the tenant's secret)"
    age = now_ms - request.created_at
    if abs(age) > policy.signature_max_age_ms:
        return (f"unauthorized: signed request created {abs(age) // 1000}s {'ago' if age > 0 else 'ahead'}; "
                f"signatures are accepted for {policy.signature_max_age_ms // 1000}s")
    return None


def cap_priority(record: TenantRecord | None, asked: Priority, policy: TenantPolicy = TenantPolicy()) -> Priority:
    """The band a tenant asking for ``asked`` gets (serve uses it before it writes the request)."""
    highest = policy.default_max_priority if record is None else record.max_priority
    return asked if asked.rank >= highest.rank else highest
