"""The gateway's admission lane: ordinary requests admitted in one C call per run of records.

For a request the gateway dispatches to the band it asked for, the Python path (decode, the
id check, :meth:`Admission.decide` with its validation, priority, quota, queue and rate-limit
steps, the counters, the re-encoding) costs about as much as everything else the gateway
does with it. ``_admit.c`` does those steps for a run of records in one call: it reads each
request in place, checks and counts it exactly as the Python path does, and writes the
dispatched record by copying the request's bytes and setting the gateway's fields.

It is a fast path, never the judge: it stops at the first record that is not ordinary in
every respect (see ``_admit.c``) without changing anything for it, and the gateway takes
that record through the Python path, which decides and explains, then resumes the lane
after it. Every record is handled in order by exactly one of the two, and the lane leaves
the tables, the queue model and the remembered ids as the Python path would, and writes the
same bytes (``tests/unit/gateway/test_admit_lane.py`` runs both on the same records).

The lane is used with the single-object wire format and the native codec, when the
request schema ends with the gateway's three fields. ``LLMQ_FAST_LANE=0`` turns it off,
with the worker's.
"""

from __future__ import annotations

import logging
import os

from pipeline.models import Priority
from pipeline.policy.fairness import _KEY_SUFFIX
from pipeline.policy.validation import MAX_CLOCK_SKEW_MS, MAX_TENANT_ID_CHARS, MAX_TOKENS_LIMIT, MAX_TRACE_ID_CHARS
from pipeline.runtime import optional_extension
from pipeline.worker.fastlane import READ_FIELDS

log = logging.getLogger(__name__)

#: The build of _admit.c this code expects (its ADMIT_ABI).
ADMIT_ABI = 2

_admit = optional_extension("pipeline.gateway._admit", ADMIT_ABI, "the gateway runs without its admission lane")

_NULL_FIRST, _NULL_SECOND = 0x10, 0x20  # _avro.h: which branch of a nullable union is null
_GATEWAY_FIELDS = ("admitted_at", "effective_priority", "degraded_from")


def lane_available() -> bool:
    """Whether ``_admit.c`` was built and is enabled (``LLMQ_FAST_LANE=0`` turns it off)."""
    return _admit is not None and os.environ.get("LLMQ_FAST_LANE", "1") != "0"


class AdmissionLane:
    """One gateway's lane: :meth:`admit` is ``_admit.admit`` with the context bound."""

    __slots__ = ("ctx", "_admit")

    def __init__(self, ctx: tuple):
        self.ctx = ctx
        self._admit = _admit.admit

    def admit(self, records: list, start: int, seen_new: dict, cancelled: dict | None) -> tuple:
        """``(stop, values, keys, owners, admitted, failure)``: see ``_admit.c``."""
        return self._admit(self.ctx, records, start, seen_new, cancelled)

    @classmethod
    def build(cls, gateway, *, now_ms, depth_key_prefix: dict) -> AdmissionLane | None:
        """The lane for this gateway, or None where it does not apply (the Python path then
        handles everything, as it would anyway)."""
        codec = gateway.codec
        if not lane_available() or gateway._wire != "single-object":
            return None
        fast = getattr(codec, "_fast_request", None)
        if fast is None or not fast.native or codec._fast_request_header is None:
            return None
        program = fast.native_decode.args[0]  # functools.partial(_native.decode, program)
        names, ops, args = program[2], program[0], program[1]
        if not set(READ_FIELDS) <= set(names) or tuple(names[-3:]) != _GATEWAY_FIELDS:
            return None
        admission = gateway.admission
        limiter, quotas, queues, policy, degrade = (admission.limiter, admission.quotas, admission.queues,
                                                    admission.priority, admission.degrade)
        for_limit = getattr(limiter.counts, "for_limit", None)
        if for_limit is None or not hasattr(quotas.counts, "admitted"):
            return None

        def view(v):
            return v.values, v.dirty, v.get

        def set_branch(op: int) -> int:  # the byte of the non-null branch of a nullable union
            return 2 if op & _NULL_FIRST else 0

        def null_byte(op: int) -> int:
            return 0 if op & _NULL_FIRST else 2

        n = len(names)
        priorities = args[names.index("priority")][0]
        effective = args[n - 2][0]
        limits = tuple((lim.name, lim.window_ms, lim.requests, lim.tokens, 1 if lim.scope == "tenant" else 0,
                        view(for_limit(lim.name))) for lim in limiter.default_limits)
        ctx = (program, tuple(names.index(f) for f in READ_FIELDS), codec._fast_request_header,
               gateway, now_ms, gateway._seen, gateway._seen_order.append,
               queues.outlook, queues.depth, queues.caps, queues.admitted,
               policy.tier_offsets, int(policy.urgent_ms), float(policy.urgent_eta_factor), float(policy.high_load),
               policy.highest_promoted.rank,
               tuple(quotas._band_caps), quotas.tenant_caps, tuple(_KEY_SUFFIX[p] for p in Priority),
               view(quotas.counts.admitted), view(quotas.counts.finished),
               dict(degrade.downgrade or {}), float(degrade.load), int(degrade.simple_prompt_tokens),
               int(degrade.simple_max_tokens),
               limits, limiter.tenant_limits, int(admission.max_timeout_ms),
               MAX_CLOCK_SKEW_MS, MAX_TOKENS_LIMIT, MAX_TENANT_ID_CHARS, MAX_TRACE_ID_CHARS,
               tuple(depth_key_prefix[p] for p in Priority), tuple(p.rank for p in priorities),
               (set_branch(ops[n - 3]), set_branch(ops[n - 2]), tuple(effective.index(p) for p in Priority),
                null_byte(ops[n - 1])))
        try:  # _admit.c checks it reads this context
            _admit.admit(ctx, [], 0, {}, None)
        except TypeError as exc:
            log.warning("the gateway's admission lane does not fit this schema or policy (%s); running without it",
                        exc)
            return None
        return cls(ctx)
