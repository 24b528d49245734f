"""One response record in: a dispatched request finished, so its tenant has one fewer outstanding
and its token buckets are corrected by what the model really used.

Responses are keyed by tenant like requests, in as many partitions, so the gateway that owns a
tenant's requests also reads its responses. An answer a worker sent elsewhere (a reply topic,
the client's own reply partition) comes with a receipt, the same record without the text, on
the receipts topic, co-partitioned the same way (TopicSettings.receipts). A terminal answer
counts once: the ids seen say whether the request is still in flight (a worker that answers
an id twice, as at-least-once allows, or an answer and its receipt, change nothing the second
time).
"""

from __future__ import annotations

import logging

from pipeline.errors import DecodeError
from pipeline.gateway.checkpoint import DecisionCheckpoint
from pipeline.gateway.seen import SeenDecisions
from pipeline.gateway.tenant_states import TenantStates
from pipeline.models import Status, now_ms
from pipeline.observability.metrics import GatewayMetrics
from pipeline.partitioning import tenant_partition
from pipeline.policy.admission import Admission

log = logging.getLogger(__name__)


class Completions:
    def __init__(self, *, codec, admission: Admission, tenants: TenantStates, seen: SeenDecisions,
                 checkpoint: DecisionCheckpoint, metrics: GatewayMetrics, partitions: int, receipts: str = ""):
        self.codec = codec
        self.admission = admission
        self.tenants = tenants
        self.seen = seen
        self.checkpoint = checkpoint
        self.metrics = metrics
        self.partitions = partitions
        #: Each source's name in the tenant records' ``applied``: the responses, the receipts.
        self.sources = {receipts: "c"}

    SOURCE = "r"

    def handle(self, event) -> None:
        msg = event.message
        try:
            self._handle(msg.value, msg.partition, msg.offset, self.sources.get(msg.topic, self.SOURCE))
        except Exception:  # noqa: BLE001 (a response the gateway cannot count is still the client's)
            log.exception("counting the completion %s[%d]@%d failed", msg.topic, msg.partition, msg.offset)
        self.checkpoint.after_write(event, [])

    def _handle(self, value: bytes, partition: int, offset: int, source: str = SOURCE) -> None:
        try:
            resp = self.codec.decode_response(value)
        except DecodeError:
            return  # the response topic's readers dead-letter nothing: not ours to judge
        if not resp.status.is_terminal or resp.admitted_at is None or resp.served_priority is None:
            return  # progress events, and answers to requests no gateway dispatched
        if tenant_partition(resp.tenant_id.encode(), self.partitions) != partition:
            # An answer in a client's own reply partition: its receipt, in the tenant's partition,
            # counts it, read by the gateway that owns the tenant (which this one may not be).
            return
        state = self.tenants.get(resp.tenant_id)
        if state.holds(source, offset):
            return  # read again after a crash: its effect is in the record already
        seen = self.seen.finished(resp.request_id, partition)
        if seen is None and self.seen.get(resp.request_id) is not None:
            return  # counted already (a second terminal answer to the same id)
        state.apply(source, offset)
        # Only a completed answer says what the model used; a failed call is settled at nothing.
        used = resp.prompt_tokens + resp.completion_tokens if resp.status is Status.COMPLETED else 0
        self.admission.finished(resp.tenant_id, state, resp.served_priority, seen.model if seen else None,
                                seen.charged if seen else 0, used, now_ms())
        self.tenants.changed(resp.tenant_id)
        if resp.started_at is not None and seen is not None:
            self.admission.queues.waited(resp.served_priority.rank, resp.started_at - resp.admitted_at, now_ms(),
                                         resp.finished_at - resp.started_at, resp.request_id)
        self.metrics.finished.labels(resp.served_priority.value, resp.status.value.lower()).inc()
