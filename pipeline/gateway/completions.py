"""One response record in: a dispatched request finished, so its tenant has one fewer outstanding
and its token buckets are corrected by what the model really used.

Responses are keyed by tenant like requests, in as many partitions, so the gateway that owns a
tenant's requests also reads its responses. A terminal answer counts once: the ids seen say
whether the request is still in flight (a worker that answers an id twice, as at-least-once
allows, changes nothing the second time).
"""

from __future__ import annotations

import logging

from pipeline.errors import DecodeError
from pipeline.gateway.checkpoint import Checkpoint
from pipeline.gateway.seen import RecentIds
from pipeline.gateway.tenants import TenantStates
from pipeline.models import Status, now_ms
from pipeline.observability.metrics import GatewayMetrics
from pipeline.policy.admission import Admission

log = logging.getLogger(__name__)


class Completions:
    def __init__(self, *, codec, admission: Admission, tenants: TenantStates, seen: RecentIds, checkpoint: Checkpoint,
                 metrics: GatewayMetrics):
        self.codec = codec
        self.admission = admission
        self.tenants = tenants
        self.seen = seen
        self.checkpoint = checkpoint
        self.metrics = metrics

    #: The responses' name in the tenant records' ``applied``.
    SOURCE = "r"

    def handle(self, event) -> None:
        msg = event.message
        try:
            self._handle(msg.value, msg.partition, msg.offset)
        except Exception:  # noqa: BLE001 (a response the gateway cannot count is still the client's)
            log.exception("counting the completion %s[%d]@%d failed", msg.topic, msg.partition, msg.offset)
        self.checkpoint.after_write(event, [])

    def _handle(self, value: bytes, partition: int, offset: int) -> None:
        try:
            resp = self.codec.decode_response(value)
        except DecodeError:
            return  # the response topic's readers dead-letter nothing: not ours to judge
        if not resp.status.is_terminal or resp.admitted_at is None or resp.served_priority is None:
            return  # progress events, and answers to requests no gateway dispatched
        state = self.tenants.get(resp.tenant_id)
        if state.holds(self.SOURCE, offset):
            return  # read again after a crash: its effect is in the record already
        seen = self.seen.finished(resp.request_id, partition)
        if seen is None and self.seen.get(resp.request_id) is not None:
            return  # counted already (a second terminal answer to the same id)
        state.apply(self.SOURCE, offset)
        # Only a completed answer says what the model used; a failed call is settled at nothing.
        used = resp.prompt_tokens + resp.completion_tokens if resp.status is Status.COMPLETED else 0
        self.admission.finished(resp.tenant_id, state, resp.served_priority, seen.model if seen else None,
                                seen.charged if seen else 0, used, now_ms())
        self.tenants.changed(resp.tenant_id)
        if resp.started_at is not None and seen is not None:
            self.admission.queues.waited(resp.served_priority.rank, resp.started_at - resp.admitted_at, now_ms())
        self.metrics.finished.labels(resp.served_priority.value, resp.status.value.lower()).inc()
