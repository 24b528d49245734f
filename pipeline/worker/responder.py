"""Each taken message's one outcome: a response or a dead letter.

At-least-once, an outcome is produced at once (publisher.py) and its offset finishes when the
broker acknowledges it; a message the broker did not acknowledge is published again, and a
fatal producer error stops the worker. Exactly-once, outcomes are handed to the offset
checkpoint, which publishes them in the transaction that commits their offsets, and a fatal
producer error restarts the session with a new producer.

An answer that does not fit the size caps (a runaway model output) still ends in a response:
a FAILED one without the output.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

from confluent_kafka import KafkaError, KafkaException

from pipeline.config import Settings
from pipeline.dlq import dead_letter_headers
from pipeline.errors import BackendError, EncodeError, KafkaOperationError
from pipeline.models import Request, Response, Status, now_ms
from pipeline.observability.metrics import WorkerMetrics, reason_code
from pipeline.serde import RESPONSE_FIELDS, Codec
from pipeline.partitioning import ANY_PARTITION
from pipeline.worker.checkpoint import OffsetCheckpoint
from pipeline.worker.records import Answered, Outcome, rd_partition
from pipeline.worker.dedupe import RecentRequests
from pipeline.worker.publisher import UNKNOWN_DESTINATION, Publisher
from pipeline.worker.scheduler import topic_bands
from pipeline.worker.state import Session, WorkerStats

log = logging.getLogger(__name__)


#: Where the output sits in a response's field values: a receipt is the answer without it.
_OUTPUT = RESPONSE_FIELDS.index("output")



def _trace(request: Request) -> dict[str, str]:
    return {"trace_id": request.trace_id} if request.trace_id else {}


def answer(request: Request, status: Status, worker_id: str, **fields) -> Response:
    """A worker's response to ``request`` other than the hot COMPLETED one.

    Every outcome carries what the gateway decided, whether or not the model was called:
    ``served_priority`` is the band the request was handled in (the gateway's
    ``effective_priority``, else the requested one), so expirations and cancellations can
    be split by the band they waited in; ``degraded`` says the gateway swapped the model.
    """
    return Response.for_request(
        request, status, worker_id=worker_id, admitted_at=request.admitted_at,
        served_priority=request.serving_priority,
        degraded=request.degraded_from is not None, metadata=_trace(request), **fields)


class Responder:
    def __init__(self, settings: Settings, codec: Codec, worker_id: str, session: Session, checkpoint: OffsetCheckpoint,
                 publisher: Publisher, recent: RecentRequests, stats: WorkerStats, metrics: WorkerMetrics):
        self.codec = codec
        self.wire = settings.serde.wire_format
        self.worker_id = worker_id
        self.responses_topic = settings.topics.responses
        self.dlq_topic = settings.topics.dlq
        self.receipts_topic = settings.topics.receipts
        self.session = session
        self.checkpoint = checkpoint
        self.recent = recent
        self.stats = stats
        self.metrics = metrics
        self.publisher = publisher
        self.targets = publisher.targets
        # A dead letter has no decoded priority: its topic's band stands in.
        self._topic_band = {topic: band.value for topic, band in topic_bands(settings).items()}

    # -- the outcomes of a decoded request ---------------------------------------------------

    def reject(self, tp, offset: int, request: Request, reason: str) -> None:
        """REJECTED for an invalid request. Not remembered as its id's answer: the id was never
        taken, and a corrected request may carry it."""
        band = request.priority._value_
        self.stats.rejected += 1
        self.metrics.outcome(band, "rejected")
        self.metrics.rejections.labels(band, reason_code(reason)).inc()
        self.respond(tp, offset, answer(request, Status.REJECTED, self.worker_id, reason=reason), remember=False,
                     target=self.targets.of(request))

    def expire(self, tp, offset: int, request: Request, started: int) -> None:
        self.stats.expired += 1
        self.metrics.outcome(request.priority._value_, "expired")
        self.respond(tp, offset, answer(
            request, Status.EXPIRED, self.worker_id, started_at=started,
            reason="deadline_passed: the request's timeout ran out before a worker took it"), target=self.targets.of(request))

    def cancelled(self, tp, offset: int, request: Request, started: int, reason: str) -> None:
        self.stats.cancelled += 1
        self.metrics.outcome(request.priority._value_, "cancelled")
        self.respond(tp, offset, answer(
            request, Status.CANCELLED, self.worker_id, reason=f"cancelled: {reason}", started_at=started),
            target=self.targets.of(request))

    def backend_failed(self, tp, offset: int, request: Request, started: int, exc: Exception,
                       backend_name: str = "") -> None:
        """The FAILED answer to a request whose backend call raised ``exc``."""
        if isinstance(exc, BackendError):
            reason = f"backend_error: {exc}"
        else:  # a bug in the backend: the request still gets its one answer
            log.error("backend %s crashed on request %s", backend_name, request.request_id, exc_info=exc)
            reason = f"backend_error: {type(exc).__name__}: {exc}"
        self.stats.failed += 1
        self.metrics.outcome(request.priority._value_, "failed")
        self.respond(tp, offset, answer(request, Status.FAILED, self.worker_id, reason=reason, started_at=started,
                                        model=request.model), target=self.targets.of(request))

    def model_unavailable(self, tp, offset: int, request: Request, started: int) -> None:
        """FAILED at once, without a call: no server is configured for the request's model, and
        no retry could change that."""
        model = "".join(c if c.isprintable() else "?" for c in request.model[:100])
        self.stats.failed += 1
        self.metrics.outcome(request.priority._value_, "failed")
        self.respond(tp, offset, answer(request, Status.FAILED, self.worker_id, started_at=started,
                                        reason=f"model_unavailable: no server for model {model}",
                                        model=request.model), target=self.targets.of(request))

    def duplicate(self, tp, offset: int, request: Request, first: tuple | None = None, again: bool = True) -> None:
        """A copy of an id taken before (see dedupe.py): the first answer's bytes again, or, the
        first still in flight, nothing (its offset finishes: the first one's answer covers it).
        ``first``: the first answer's ``(value, key)`` as known when the copy was checked;
        ``again``: False when the first answer, known, covers the copy too (nothing is sent).

        Another tenant's request with that id is refused instead: the first answer is not its
        to read. It still says nothing while the first runs, since clients wait for an id's
        first answer, whoever it is keyed by."""
        first = self.recent.answer_of(request.request_id) or first
        if first is None or (not again and first[1] == request.tenant_id.encode()):
            self.stats.duplicates += 1
            self.metrics.duplicates.labels("dropped").inc()
            self.checkpoint.finished(tp, offset)
            return
        value, key = first
        if key != request.tenant_id.encode():
            self.reject(tp, offset, request, "duplicate_request_id: this request id was already taken by this "
                                             "worker; the first submission is answered")
            return
        self.stats.duplicates += 1
        self.metrics.duplicates.labels("repeated").inc()
        topic, partition = self.targets.of(request)  # where this copy asked for it
        self.emit(tp, offset, topic, value, key, None, partition)

    def completed_many(self, done: list[Answered], started: int, seconds: float = 0.0) -> None:
        """The COMPLETED answers of ``done``, the
        backend having taken ``seconds`` for each (0 for answers it gave at once)."""
        self.stats.completed += len(done)
        self.metrics.completed_many(done, seconds)
        finished = now_ms()
        encode, wire, default_topic, worker_id = self.codec.encode_response_values, self.wire, \
            self.responses_topic, self.worker_id
        target = self.targets.of
        checkpoint = self.checkpoint
        hold = checkpoint.hold if checkpoint.exactly_once else None
        remember = self.recent.answered if self.recent.window else None
        # Exactly-once, the producer is not needed here (and is None once abandoned).
        produce = self.session.producer.produce if hold is None else None
        delivered, partial = self._delivered, functools.partial
        completed = Status.COMPLETED
        for tp, offset, request, c in done:
            # RESPONSE_FIELDS order; the gateway fields are copied as answer() copies them.
            values = (request.request_id, request.tenant_id, completed, None, c.output, c.prompt_tokens,
                      c.completion_tokens, c.model, request.degraded_from is not None, request.priority,
                      request.serving_priority, request.created_at, request.admitted_at,
                      started, finished, worker_id, None,
                      {"trace_id": request.trace_id} if request.trace_id else {}, None, None,
                      c.finish_reason, c.usage_estimated)
            if request.reply_to is None and request.reply_partition is None:
                topic, partition = default_topic, ANY_PARTITION
            else:
                topic, partition = target(request)
            try:
                value = encode(values, wire, topic)
            except EncodeError as exc:
                value = self.publisher.failed_instead(Response(**dict(zip(RESPONSE_FIELDS, values))), f"response_too_large: {exc}")
            key = request.tenant_id.encode()
            if remember is not None:
                remember(request.request_id, (tp, offset), value, key)
            receipt = None
            if partition is not ANY_PARTITION or topic != default_topic:
                receipt = self._receipt_of(request, values, key, topic, partition)
            if hold is not None:
                hold(tp, offset, Outcome(topic, value, key, None, partition), receipt)
            else:
                on_delivery = partial(delivered, tp, offset) if receipt is None else \
                    partial(self._answered, tp, offset, receipt[1])
                try:
                    produce(topic, value, key, partition=rd_partition(partition), on_delivery=on_delivery)
                except (BufferError, KafkaException):  # queue full, or too large: the careful path
                    self.publisher.produce(topic, value, key, None, on_delivery, partition)

    def respond(self, tp, offset: int, response: Response, remember: bool = True,
                target: tuple[str, int | None] | None = None) -> None:
        """Publish ``response`` as the outcome of the message at ``tp``/``offset``, to ``target``
        ``(topic, partition)`` (the request's reply destination; default the responses topic)."""
        topic, partition = target or (self.responses_topic, ANY_PARTITION)
        try:
            value = self.codec.encode_response(response, self.wire, topic)
        except EncodeError as exc:
            value = self.publisher.failed_instead(response, f"response_too_large: {exc}")
        key = response.tenant_id.encode()
        if remember:
            self.recent.answered(response.request_id, (tp, offset), value, key)
        receipt = None
        if response.admitted_at is not None and not self.targets.is_home(key, topic, partition):
            receipt = self.codec.encode_response(dataclasses.replace(response, output=None), self.wire,
                                                 self.receipts_topic)
        self.emit(tp, offset, topic, value, key, None, partition, receipt)

    def _receipt_of(self, request: Request, values: tuple, key: bytes, topic: str, partition: int | None) -> Outcome | None:
        """The receipt of a COMPLETED answer headed for ``topic``/``partition`` (None if the
        gateway reads it there, or no gateway dispatched the request)."""
        if request.admitted_at is None or self.targets.is_home(key, topic, partition):
            return None
        receipt = self.codec.encode_response_values(values[:_OUTPUT] + (None,) + values[_OUTPUT + 1:], self.wire,
                                                   self.receipts_topic)
        return Outcome(self.receipts_topic, receipt, key)

    # -- publishing ------------------------------------------------------------------------

    def dead_letter(self, msg, tp, offset: int, reason: str, error: str) -> None:
        self.stats.dead_lettered += 1
        self.metrics.dead_letters.labels(reason).inc()
        self.metrics.outcome(self._topic_band.get(tp[0], "UNKNOWN"), "dead_lettered")
        log.warning("dead-lettering %s[%d]@%d: %s", tp[0], tp[1], offset, error)
        headers = dead_letter_headers(tp[0], tp[1], offset, reason, error, "worker", msg.headers())
        self.emit(tp, offset, self.dlq_topic, msg.value(), msg.key(), headers)

    def emit(self, tp, offset: int, topic: str, value, key, headers, partition: int | None = ANY_PARTITION,
             receipt: bytes | None = None) -> None:
        """Publish the one outcome of the message at ``tp``/``offset``, and its ``receipt`` (an
        answer that goes where the gateway does not read: see TopicSettings.receipts).

        At-least-once the receipt is produced once the answer is acknowledged, and the offset
        finishes once the receipt is: a crash in between answers the request again (the
        client drops the repeat) rather than leaving its tenant's quota taken for good."""
        if self.checkpoint.exactly_once:
            self.checkpoint.hold(tp, offset, Outcome(topic, value, key, headers, partition),
                                 None if receipt is None else Outcome(self.receipts_topic, receipt, key))
        elif receipt is None:
            self.publisher.produce(topic, value, key, headers, functools.partial(self._delivered, tp, offset), partition)
        else:
            self.publisher.produce(topic, value, key, headers, functools.partial(self._answered, tp, offset, receipt), partition)

    def _answered(self, tp, offset: int, receipt: bytes, err, msg) -> None:
        """The answer is acknowledged (or not): now its receipt, whose delivery finishes the offset."""
        if err is None:
            self.publisher.produce(self.receipts_topic, receipt, msg.key(), None, functools.partial(self._delivered, tp, offset))
            return
        self._not_delivered(err, msg, functools.partial(self._answered, tp, offset, receipt),
                            f"{tp[0]}[{tp[1]}]@{offset}")

    def _delivered(self, tp, offset: int, err, msg) -> None:
        if err is None:
            self.checkpoint.tracker.finished(tp, offset)
            stats = self.stats
            stats.delivered += 1
            stats.last_delivered_at = time.perf_counter()
            return
        self._not_delivered(err, msg, functools.partial(self._delivered, tp, offset), f"{tp[0]}[{tp[1]}]@{offset}")

    def _not_delivered(self, err, msg, on_delivery, what: str) -> None:
        """A message the broker did not acknowledge: publish it again, smaller if it was too
        large, to the responses topic if its reply topic or partition does not exist, or stop
        on a fatal error; its offset is not committed meanwhile."""
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
            self.publisher.produce(*self.publisher.shrunk(msg.topic(), msg.value(), msg.key(), msg.headers()), on_delivery,
                         _any_if_unset(msg.partition()))
            return
        if err.code() in UNKNOWN_DESTINATION:
            instead = self.targets.fallback(msg.topic(), _any_if_unset(msg.partition()))
            if instead is not None:
                log.warning("response for %s: %s; publishing it to %s", what, err, instead[0])
                self.publisher.produce(instead[0], msg.value(), msg.key(), msg.headers(), on_delivery, instead[1])
                return
        if err.fatal():
            if self.checkpoint.exactly_once:
                # A transactional producer's fatal error (fenced, or a transaction the coordinator
                # lost track of while it moved) ends that producer, not the worker: the session
                # starts over from the committed offsets with a new one, which fences it.
                self.session.restart = True
                log.warning("fatal producer error (%s): starting over from the committed offsets with a new "
                            "producer", err)
                return
            self.session.fail(KafkaOperationError("produce response", err.str(), err))
            log.error("fatal producer error, stopping without committing %s: %s", what, err)
            return
        # Not acknowledged: never commit past it; publish again (idempotent producer).
        self.stats.delivery_retries += 1
        log.warning("response for %s not delivered (%s); retrying", what, err)
        self.publisher.produce(msg.topic(), msg.value(), msg.key(), msg.headers(), on_delivery, _any_if_unset(msg.partition()))



def _any_if_unset(partition: int | None) -> int | None:
    """A delivered message's partition as llmq spells it (librdkafka reports -1 for none)."""
    return partition if partition is not None and partition >= 0 else ANY_PARTITION
