"""The tenant registry's records as the gateway applies them: who may send, at which tier and
band, under which limits and caps; the config's own per-tenant tables still come first."""

from __future__ import annotations

import asyncio

from pipeline.config import Settings
from pipeline.gateway.intake import Intake
from pipeline.models import BANDS, Priority, Request, Status
from pipeline.observability.metrics import GatewayMetrics
from pipeline.policy.admission import Admission, DegradePolicy, RateLimits
from pipeline.policy.fairness import FairnessQuotas
from pipeline.policy.priority import PriorityPolicy
from pipeline.policy.queues import QueueModel
from pipeline.tenants.registry import TenantRegistry

RECORDS = {
    "acme": {"tier": "enterprise", "max_priority": "HIGH", "models": ["small"],
             "limits": {"tight": {"window_ms": 60_000, "requests": 2, "over": "refuse"}}},
    "banned": {"enabled": False},
    "capped": {"outstanding": {"NORMAL": 1}},
}


def _intake(gw, require_known=False):
    settings = Settings.load(env={})
    settings.tenants.records = RECORDS
    settings.tenants.require_known = require_known
    registry = TenantRegistry(settings)
    lookup_limits = lambda t: None if registry.get(t) is None else registry.get(t).limits  # noqa: E731
    lookup_caps = lambda t: None if registry.get(t) is None else registry.get(t).outstanding  # noqa: E731
    gw.admission = Admission(PriorityPolicy(), RateLimits([], lookup=lookup_limits),
                             FairnessQuotas({}, floor=Priority.LOW, lookup=lookup_caps),
                             QueueModel([0] * len(BANDS)), DegradePolicy())
    gw.intake = Intake(codec=gw.codec, wire="single-object", topics=gw.settings.topics, admission=gw.admission,
                       tenants=gw.tenants, seen=gw.seen, checkpoint=gw.checkpoint, metrics=GatewayMetrics(),
                       authorize=registry.authorize)
    return gw


def _sent(gw, *reqs):
    for req in reqs:
        gw.intake.handle(gw.request_event(req))
    asyncio.run(gw.checkpoint.round())
    gw.outputs.deliver()
    out = []
    for output, _ in gw.outputs.sent_before:
        if output.topic == gw.settings.topics.responses:
            out.append(("answer", gw.codec.decode_response(output.value)))
        else:
            out.append((output.topic, gw.codec.decode_request(output.value)))
    return out


def test_a_registered_tenant_gets_its_tier_and_band_whatever_the_request_claims(gw):
    _intake(gw)
    [(topic, req)] = _sent(gw, Request.new("acme", "hi", model="small", priority=Priority.CRITICAL,
                                           user_tier="free", timeout_ms=600_000))
    assert topic == gw.settings.topics.dispatch_topic(Priority.HIGH)  # capped at its max_priority
    assert req.user_tier == "enterprise"


def test_refusals_by_the_registry_are_answered_with_the_reason_and_the_same_again(gw):
    _intake(gw, require_known=True)
    stranger = Request.new("nobody", "hi", timeout_ms=600_000)
    out = _sent(gw, Request.new("banned", "hi", timeout_ms=600_000),
                Request.new("acme", "hi", model="large", timeout_ms=600_000), stranger)
    reasons = [a.reason for kind, a in out if kind == "answer" and a.status is Status.REJECTED]
    assert [r.split(":")[0] for r in reasons] == ["unauthorized", "forbidden", "unauthorized"]
    assert "large" in reasons[1] and "small" in reasons[1]
    [(kind, again)] = _sent(gw, stranger)
    assert kind == "answer" and again.reason == reasons[2]


def test_the_records_limits_and_caps_replace_the_defaults(gw):
    _intake(gw)
    out = _sent(gw, *(Request.new("acme", f"r{i}", model="small", timeout_ms=600_000) for i in range(3)))
    assert [a.reason.split(":")[0] for kind, a in out if kind == "answer"] == ["rate_limited"]
    out = _sent(gw, *(Request.new("capped", f"c{i}", timeout_ms=600_000) for i in range(2)))
    bands = [topic for topic, _ in out if topic != "answer"]
    # The second outstanding NORMAL request of a tenant capped at one is served a band lower.
    assert bands == [gw.settings.topics.dispatch_topic(Priority.NORMAL), gw.settings.topics.dispatch_topic(Priority.LOW)]
