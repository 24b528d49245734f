"""One request record in: decoded, recognised if seen before, decided, its outputs queued.

The decision changes the tenant's state and the ids seen in memory at once (the next request
sees it), its outputs go out, and the :class:`~pipeline.gateway.checkpoint.DecisionCheckpoint`
writes the decision and the state behind it; the tenants' records say through which offset of
each source they hold the effects (:meth:`pipeline.policy.state.TenantState.holds`). So after a
crash a request is either

* redelivered with no decision recorded: it is decided again (see the checkpoint for when that
  can differ from an answer that had gone out);
* redelivered with its decision recorded: the same outputs go out again, unchanged, and its
  effect on the tenant's state is applied again only if the record does not hold it
  (at-least-once repeats an answer, and charges it once).

A request id submitted again (from another offset) is dropped while the first copy waits for
its answer; one the gateway answered itself gets that answer again; one whose answer came from
a worker is dispatched again as it was the first time (the worker answers a known id with the
answer it gave).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from pipeline.dlq import dead_letter_headers
from pipeline.errors import DecodeError, EncodeError, LimitExceeded
from pipeline.gateway.checkpoint import DecisionCheckpoint
from pipeline.gateway.outputs import Output
from pipeline.gateway.seen import Seen, SeenDecisions
from pipeline.gateway.tenant_states import TenantStates
from pipeline.models import (BANDS, DISPATCHED_AGAIN_HEADER, NOT_BEFORE_HEADER, REDELIVERED, RESUBMITTED,
                             Priority, Request, Response, Status, now_ms)
from pipeline.observability.metrics import GatewayMetrics, reason_code
from pipeline.policy.admission import Action, Admission, Decision
from pipeline.policy.shadow import Shadow
from pipeline.tenants.policy import Authorization

log = logging.getLogger(__name__)

_STATUS = {Action.REJECT: Status.REJECTED, Action.EXPIRE: Status.EXPIRED, Action.CANCEL: Status.CANCELLED}
_OUTCOME = {Status.REJECTED: "rejected", Status.EXPIRED: "expired", Status.CANCELLED: "cancelled"}
#: A decision as the metrics name it.
_DECIDED = {Action.DISPATCH: "admitted", Action.REJECT: "rejected", Action.EXPIRE: "expired",
            Action.CANCEL: "cancelled"}


#: The furthest back a request's record timestamp is believed (a producer's clock may be off).
_MAX_ARRIVAL_LAG_MS = 60_000


def arrival_ms(timestamp_s: float | None, now: int) -> int:
    """When a request reached Kafka, by its record's timestamp (Faust gives seconds), never in the
    future and at most a minute back: a producer's clock bends the rate limits that little at most."""
    if not timestamp_s:
        return now
    return min(now, max(int(timestamp_s * 1000), now - _MAX_ARRIVAL_LAG_MS))


class Intake:
    def __init__(self, *, codec, wire: str, admission: Admission, tenants: TenantStates, seen: SeenDecisions,
                 checkpoint: DecisionCheckpoint, topics, metrics: GatewayMetrics,
                 cancelled=lambda request_id: False, authorize: Callable[..., Authorization] | None = None,
                 shadow: Shadow | None = None):
        self.codec = codec
        self.wire = wire
        self.admission = admission
        self.tenants = tenants
        self.seen = seen
        self.checkpoint = checkpoint
        self.metrics = metrics
        self.cancelled = cancelled
        #: The tenant registry's verdict (pipeline/tenants/policy.py); None: every tenant as it says.
        self.authorize = authorize
        #: The shadow policy ([gateway.shadow]), judged and counted beside the real one; None: off.
        self.shadow = shadow
        self.responses = topics.responses
        self.response_partitions = topics.response_partitions
        self.dlq = topics.dlq
        self.dispatch = {p: topics.dispatch_topic(p) for p in BANDS}
        #: A request topic's name in the tenant records' ``applied`` (its band's rank).
        self.sources = {topics.request_topic(p): str(p.rank) for p in BANDS}

    def handle(self, event, before: Iterable = ()) -> None:
        """Decide ``event``'s record, after ``before`` (records of its partition Faust skipped,
        see positions.py): all their answers and decisions are written as the event's."""
        outputs: list[Output] = []
        for msg in (*before, event.message):
            mine: list[Output] = []
            try:
                self._handle(msg, mine)
            except Exception as exc:  # noqa: BLE001 (a bug must neither stop the gateway nor lose the request)
                log.exception("admitting %s[%d]@%d failed", msg.topic, msg.partition, msg.offset)
                mine = [self._dead_letter(msg, "gateway_error", f"{type(exc).__name__}: {exc}")]
            outputs += mine
        self.checkpoint.after_write(event, outputs)

    def charge_recorded(self, owns) -> int:
        """After a rebalance, before anything new is decided: every admission the decision log
        holds (from whichever gateway decided it) and its tenant's record does not, charged to the
        buckets at its arrival. Left to the redelivered request itself, a recorded admission in a
        lower band's partition would be charged only after fresher requests of a higher band had
        been decided on buckets without it, and the limit would let through more than its burst
        across a failover. Returns how many were charged."""
        charged = 0
        for seen in self.seen.recorded():
            if seen.dispatched < 0:
                continue
            topic, partition, offset = seen.source.rsplit(":", 2)
            if not owns(int(partition)):
                continue
            applied = self.sources.get(topic, topic)
            state = self.tenants.get(seen.tenant)
            if state.holds(applied, int(offset)):
                continue
            self.admission.admitted_again(seen.tenant, state, BANDS[seen.dispatched], seen.model, seen.charged,
                                          seen.arrived_ms)
            state.apply(applied, int(offset))
            self.tenants.changed(seen.tenant)
            charged += 1
        return charged

    def _handle(self, msg, outputs: list[Output]) -> None:
        refusal = None  # over a size cap, yet readable: refused like an invalid request, not dead-lettered
        try:
            req = self.codec.decode_request(msg.value)
        except LimitExceeded as exc:
            if exc.request is None:
                outputs.append(self._dead_letter(msg, exc.reason, str(exc)))
                return
            req, refusal = exc.request, exc.refusal
        except DecodeError as exc:
            outputs.append(self._dead_letter(msg, exc.reason, str(exc)))
            return
        source = f"{msg.topic}:{msg.partition}:{msg.offset}"
        applied = self.sources.get(msg.topic, msg.topic)
        seen = self.seen.get(req.request_id)
        if seen is not None:
            redelivered = seen.source == source
            if redelivered and seen.dispatched >= 0:
                state = self.tenants.get(req.tenant_id)
                if not state.holds(applied, msg.offset):
                    self.admission.admitted_again(req.tenant_id, state, BANDS[seen.dispatched],
                                                  seen.model or req.model, seen.charged, seen.arrived_ms)
                    state.apply(applied, msg.offset)
                    self.tenants.changed(req.tenant_id)
            self._again(req, seen, redelivered, outputs, refusal)
            return
        now = now_ms()
        if self.authorize is not None:
            auth = self.authorize(req, msg.headers, msg.value, now)
            if auth.problem is not None:
                self._refuse(req, source, msg.partition, now, auth.problem, outputs)
                return
            req = auth.request
        if refusal is not None:
            self._refuse(req, source, msg.partition, now, refusal, outputs)
            return
        arrived = arrival_ms(msg.timestamp, now)
        state = self.tenants.get(req.tenant_id)
        cancelled = self.cancelled(req.request_id)
        # Before the real decision, which counts the request in the state both read.
        shadow = None if self.shadow is None else self.shadow.judge(req, now, state, cancelled=cancelled,
                                                                     arrived_ms=arrived)
        decision = self.admission.decide(req, now, state, cancelled=cancelled, arrived_ms=arrived)
        state.apply(applied, msg.offset)
        m = self.metrics
        if shadow is not None:
            self._count_shadow(shadow, decision)
        if decision.action is Action.DISPATCH:
            self.tenants.changed(req.tenant_id)
            band = decision.band
            self.seen.add(req.request_id, msg.partition, Seen(source, req.tenant_id, now, band.rank, decision.model or "",
                                               decision.charged_tokens, decision.degraded_from or "", in_flight=True,
                                               arrived_ms=arrived, not_before_ms=decision.not_before_ms))
            m.outcome(req.priority.value, "admitted")
            if decision.degraded_from is not None:
                m.degraded.labels(req.priority.value).inc()
            if band is not req.priority:
                m.reprioritised.labels(req.priority.value, band.value).inc()
            if req.notify_queued:
                # Produced before the dispatch so that it is not overtaken by the answer of a
                # fast worker. Kafka orders nothing across topics, so a client still takes the
                # answer as the first word if it comes first.
                eta = decision.eta_ms
                outputs.append(self._answer(Response.for_request(
                    req, Status.QUEUED, admitted_at=now, served_priority=band, queue_position=decision.position,
                    eta_ms=None if eta is None or eta == float("inf") else int(eta), model=decision.model or req.model,
                    degraded=decision.degraded_from is not None), req))
            self._dispatch(req, now, band, decision.model, decision.degraded_from, outputs, decision.not_before_ms)
            return
        status = _STATUS[decision.action]
        self.seen.add(req.request_id, msg.partition, Seen(source, req.tenant_id, now, status=status.value,
                                           reason=decision.reason or "", retry_after_ms=decision.retry_after_ms or 0,
                                           served=decision.band.rank if decision.band is not None else -1))
        m.outcome(req.priority.value, _OUTCOME[status])
        if status is Status.REJECTED:
            m.rejections.labels(req.priority.value, reason_code(decision.reason)).inc()
        outputs.append(self._answer(Response.for_request(req, status, reason=decision.reason,
                                                         retry_after_ms=decision.retry_after_ms,
                                                         served_priority=decision.band, finished_at=now), req))

    def _count_shadow(self, shadow: Decision, real: Decision) -> None:
        decided = _DECIDED[shadow.action]
        self.metrics.shadow.labels(decided, reason_code(shadow.reason)).inc()
        if shadow.action is not real.action:
            self.metrics.shadow_disagreements.labels(_DECIDED[real.action], decided).inc()

    def _refuse(self, req: Request, source: str, partition: int, now: int, reason: str,
                outputs: list[Output]) -> None:
        """Refused by the registry (unknown, disabled, unsigned, a model not allowed) or for a field
        over its size cap: answered REJECTED with the reason, remembered like any other answer,
        charged nothing."""
        self.seen.add(req.request_id, partition, Seen(source, req.tenant_id, now, status=Status.REJECTED.value,
                                                      reason=reason))
        self.metrics.outcome(req.priority.value, "rejected")
        self.metrics.rejections.labels(req.priority.value, reason_code(reason)).inc()
        outputs.append(self._answer(Response.for_request(req, Status.REJECTED, reason=reason, finished_at=now), req))

    def _again(self, req: Request, seen: Seen, redelivered: bool, outputs: list[Output],
               refusal: str | None = None) -> None:
        """A request whose id was decided before: the same outcome again, or nothing. A copy over a
        size cap (``refusal``) of an id already dispatched cannot be dispatched again for its worker
        to repeat the answer, and refusing it would give the id a second, different answer: the
        first answer stands for it."""
        m = self.metrics
        if seen.status:  # answered by the gateway: that answer again
            m.outcome(req.priority.value, "redelivered" if redelivered else "duplicate")
            outputs.append(self._answer(Response.for_request(
                req, Status(seen.status), reason=seen.reason or None, retry_after_ms=seen.retry_after_ms or None,
                served_priority=BANDS[seen.served] if seen.served >= 0 else None, finished_at=seen.at_ms), req))
            return
        if not redelivered and seen.in_flight:
            m.outcome(req.priority.value, "duplicate")  # its first copy is still on its way: that answer covers it
            return
        m.outcome(req.priority.value, "redelivered" if redelivered else "duplicate")
        if refusal is not None:
            return
        band = BANDS[seen.dispatched]
        self._dispatch(req, seen.at_ms, band, seen.model or req.model, seen.degraded_from or None, outputs,
                       seen.not_before_ms, again=REDELIVERED if redelivered else RESUBMITTED)

    def _dispatch(self, req: Request, admitted_at: int, band: Priority, model: str, degraded_from: str | None,
                  outputs: list[Output], not_before_ms: int = 0, again: bytes | None = None) -> None:
        """``again``: the id was dispatched before (its first copy may have gone out already), and
        why (REDELIVERED, RESUBMITTED): a worker that did not take that copy reads its answer back
        instead of running it again."""
        req.admitted_at = admitted_at
        req.effective_priority = band
        if model:  # degraded, or the default of a request that named none
            req.model = model
        if degraded_from is not None:
            req.degraded_from = degraded_from
        topic = self.dispatch[band]
        # Shaped by a rate limit: workers hold it until then (pipeline/worker/scheduler.py).
        headers = [(NOT_BEFORE_HEADER, b"%d" % not_before_ms)] if not_before_ms else None
        if again is not None:
            headers = [*(headers or ()), (DISPATCHED_AGAIN_HEADER, again)]
        outputs.append(Output(topic, self.codec.encode_request(req, self.wire, topic), req.tenant_id.encode(), headers))

    def _answer(self, response: Response, req: Request) -> Output:
        """The answer to ``req``, to the partition of the responses its client reads when it named
        one (a partition the topic does not have: the tenant's, as for every other answer)."""
        try:
            value = self.codec.encode_response(response, self.wire, self.responses)
        except EncodeError as exc:
            # A refusal echoes nothing big, but a reason could still be long: keep it short.
            response.reason = f"{(response.reason or '')[:200]} ({exc})"[:500]
            value = self.codec.encode_response(response, self.wire, self.responses)
        partition = req.reply_partition
        if partition is not None and not 0 <= partition < self.response_partitions:
            partition = None
        return Output(self.responses, value, response.tenant_id.encode(), partition=partition)

    def _dead_letter(self, msg, reason: str, detail: str) -> Output:
        self.metrics.outcome("UNKNOWN", "dead_lettered")
        self.metrics.dead_letters.labels(reason).inc()
        log.warning("dead-lettering %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, detail)
        headers = dead_letter_headers(msg.topic, msg.partition, msg.offset, reason, detail, "gateway",
                                      list(msg.headers.items()) if isinstance(msg.headers, dict)
                                      else list(msg.headers or ()))
        return Output(self.dlq, msg.value, msg.key, headers)
