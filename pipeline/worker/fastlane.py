"""The worker's fast lane: ordinary requests answered at once, in one C call per batch.

When the backend answers without waiting (the simulated model with no latency), the
Python cost of a request — decode, checks, backend, answer, bookkeeping, one step after
another — is most of what a worker spends on it. ``_lane.c`` does those steps for a run of
consumed messages in one call, and returns the encoded answers, their keys, where they came
from (for the offset tracker) and the metric counts, summed.

It is a fast path, never the judge: it stops at the first message that is not ordinary in
every respect (see ``_lane.c``), and the worker takes that one through the Python path,
which decides and explains, then resumes the lane after it. Every message is handled in
consumption order by exactly one of the two, and a lane answer is the bytes the Python
path writes (``tests/unit/worker/test_fastlane.py`` compares them).

The lane is used only where it cannot change an outcome or an order: the single-object
wire format with the native codec, the simulated backend without latency, and an empty
band backlog, and a consumed batch of one topic (a batch of several bands goes to the
band queues, whose scheduler orders the bands). ``LLMQ_FAST_LANE=0`` turns
it off.
"""

from __future__ import annotations

import logging
import os

from pipeline.models import Priority, Status
from pipeline.observability.metrics import WAIT_BUCKETS
from pipeline.policy.validation import MAX_CLOCK_SKEW_MS, MAX_TENANT_ID_CHARS, MAX_TOKENS_LIMIT, MAX_TRACE_ID_CHARS
from pipeline.runtime import optional_extension
from pipeline.serde import RESPONSE_FIELDS

log = logging.getLogger(__name__)

#: The build of _lane.c this code expects (its LANE_ABI).
LANE_ABI = 4

_lane = optional_extension("pipeline.worker._lane", LANE_ABI, "the worker runs without its fast lane")

#: The request fields _lane.c reads, in its F_* order.
READ_FIELDS = ("request_id", "tenant_id", "priority", "prompt", "model", "max_tokens", "created_at", "timeout_ms",
               "trace_id", "admitted_at", "effective_priority", "degraded_from", "user_tier", "allow_degrade",
               "notify_queued")
#: The response fields it writes, in its R_* order (the model's field order, RESPONSE_FIELDS).
WRITE_FIELDS = ("request_id", "tenant_id", "status", "reason", "output", "prompt_tokens", "completion_tokens",
                "model", "degraded", "requested_priority", "served_priority", "created_at", "admitted_at",
                "started_at", "finished_at", "worker_id", "retry_after_ms", "metadata", "queue_position", "eta_ms")

#: Band index (the lane's) -> priority name, highest first.
BAND_NAMES = tuple(p.value for p in Priority)


def lane_available() -> bool:
    """Whether ``_lane.c`` was built and is enabled (``LLMQ_FAST_LANE=0`` turns it off)."""
    return _lane is not None and os.environ.get("LLMQ_FAST_LANE", "1") != "0"


class FastLane:
    """One worker session's lane: :meth:`run` is ``_lane.run`` with the context bound."""

    __slots__ = ("ctx", "_run", "ranks", "Countdown", "produce_all")

    def __init__(self, ctx: tuple):
        self.ctx = ctx
        self._run = _lane.run
        #: ranks(msgs, rank, default): None when all have one topic, else each one's rank
        self.ranks = _lane.ranks
        #: Countdown(count, done, failed): one lane call's delivery callback (see _lane.c)
        self.Countdown = _lane.Countdown
        #: produce_all(produce, topic, values, keys, on_delivery, retry) -> how many were produced
        self.produce_all = _lane.produce_all

    def run(self, msgs: list, start: int, started_ms: int, finished_ms: int) -> tuple:
        """``(stop, values, keys, ids, runs, bands, tenants, models)``: see ``_lane.c``."""
        return self._run(self.ctx, msgs, start, started_ms, finished_ms)

    @classmethod
    def build(cls, *, codec, wire: str, backend, worker_id: str, seen: set, cancelled: dict | None) -> FastLane | None:
        """The lane for these parts, or None where it does not apply (the Python path then
        handles everything, as it would anyway)."""
        from pipeline.worker.backends.simulated import SimulatedBackend

        if not lane_available() or wire != "single-object":
            return None
        if type(backend) is not SimulatedBackend or backend.latency_ms != 0 or backend.ms_per_token != 0:
            return None
        request_fast, response_fast = getattr(codec, "_fast_request", None), getattr(codec, "_fast_response", None)
        if request_fast is None or response_fast is None or not request_fast.native or not response_fast.native or \
                codec._fast_request_header is None or RESPONSE_FIELDS != WRITE_FIELDS:
            return None
        request_program = request_fast.native_decode.args[0]  # functools.partial(_native.decode, program)
        response_program = response_fast.encode_values.args[0]
        names = request_program[2]
        if not set(READ_FIELDS) <= set(names) or not isinstance(cancelled, (dict, type(None))):
            return None
        answers = tuple(tuple(a) for a in backend._answers)
        ctx = (request_program, tuple(names.index(f) for f in READ_FIELDS), codec._fast_request_header,
               response_program, codec._response_header, Status.COMPLETED, worker_id, answers,
               backend.max_output_tokens, seen, cancelled, {p: i for i, p in enumerate(Priority)},
               tuple(float(b) for b in WAIT_BUCKETS), MAX_CLOCK_SKEW_MS, MAX_TOKENS_LIMIT, MAX_TENANT_ID_CHARS,
               MAX_TRACE_ID_CHARS)
        try:  # _lane.c checks the programs are the ones it reads and writes
            _lane.run(ctx, [], 0, 0, 0)
        except TypeError as exc:
            log.warning("the worker's fast lane does not fit these schemas (%s); running without it", exc)
            return None
        return cls(ctx)
