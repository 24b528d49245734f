"""Runs the batches this ``llmq serve`` process owns: one thread, three Kafka clients.

Ownership: every serve process is a member of the batch group (``batch.group_id``) on the
batches topic; a batch belongs to the member holding its partition. When a process dies, its
partitions, and so its batches, move to another member after the group's session timeout;
a process that starts again takes its share back.

A batch, once owned:

1. ``validating``: its input file is read and its lines checked (:mod:`.lines`); the record
   goes to ``in_progress`` with ``answers_from``, the end of its reply partition of the
   responses at that moment: every answer to one of its lines comes after it.
2. ``in_progress``: lines are sent in the batch's band, at most ``batch.max_outstanding``
   unanswered, each with its own deadline within the window and the reply partition of the
   batch. Answers are read from that partition (:class:`.progress.BatchProgress` keeps the
   first per line); request_counts are published every ``batch.progress_interval_ms``.
3. all lines final → ``finalizing``: output and error files written → ``completed``.

Cancel: lines not sent are cancelled, the sent ones get a cancellation and up to
``batch.cancel_grace_s`` to answer, then ``cancelled``. Window closed: lines not sent expire,
the sent ones answer on their own deadlines (the window's end), then ``expired``.

A new owner (after a crash, a SIGTERM or a rebalance) reads the batch's answers again from
``answers_from`` before it sends anything, then sends every line still without an answer under
its current attempt's id: the gateway answers an id it has seen once, so a line already on its
way is not run twice, and a line answered twice keeps its first answer.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaException, TopicPartition

from pipeline.batch import record as R
from pipeline.batch.lines import Line, error_line, jsonl, output_line, parse_lines
from pipeline.batch.progress import BatchProgress, Verdict
from pipeline.batch.store import BatchStore
from pipeline.errors import DecodeError, EncodeError, LlmqError
from pipeline.models import Priority, Request, Response, now_ms
from pipeline.serde import Codec

log = logging.getLogger("pipeline.batch")

EXPIRED_LINE = Verdict("batch_expired", "This request could not be executed before the completion window expired.")
CANCELLED_LINE = Verdict("batch_cancelled", "This request was not executed: the batch was cancelled.")
#: After the window closes, how long the lines already sent get to answer (they expire on
#: their own deadlines, the window's end) before the driver calls them expired.
_WINDOW_GRACE_MS = 30_000
_SWEEP_S = 60.0


@dataclass
class Run:
    """A batch this process drives."""

    record: R.BatchRecord
    lines: list[Line]
    progress: BatchProgress
    catch_up_to: int  # the reply partition's end when adopted: no sending before reading to it
    caught_up: bool = False
    cancel_until_ms: int = 0
    published_ms: int = 0
    published: tuple = field(default_factory=tuple)


class BatchDriver:
    def __init__(self, settings, store: BatchStore, registry, client, codec: Codec | None = None):
        self.settings = settings
        self.cfg = settings.batch
        self.store = store
        self.registry = registry
        self.client = client  # an LlmqClient that does not listen: it sends the lines and the cancels
        self.codec = codec or Codec.default()
        self.responses = settings.topics.responses
        self.runs: dict[str, Run] = {}
        self.owned: set[int] = set()
        self._assigned: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._swept = 0.0
        group = self.cfg.group(settings.topics.prefix)
        self._group = Consumer(settings.kafka.consumer_config(group, **{
            "enable.auto.commit": False, "session.timeout.ms": self.cfg.session_timeout_ms,
            "heartbeat.interval.ms": max(1000, self.cfg.session_timeout_ms // 5)}))
        self._answers = Consumer(settings.kafka.consumer_config("llmq-batch-answers-unused", **{
            "enable.auto.commit": False, "enable.partition.eof": False, "isolation.level": "read_committed",
            "fetch.wait.max.ms": 50}))

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._group.subscribe([self.settings.topics.batches], on_assign=self._on_assign, on_revoke=self._on_revoke,
                              on_lost=self._on_revoke)
        self._thread = threading.Thread(target=self._loop, name="llmq-batch-driver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for consumer in (self._group, self._answers):
            try:
                consumer.close()  # leaving the group hands the batches over at once
            except (KafkaException, RuntimeError):
                pass
        self.client.close()

    def _on_assign(self, consumer, parts) -> None:
        # The group only says who owns what; the index (the store) reads the records.
        consumer.pause(parts)
        self.owned |= {p.partition for p in parts}
        log.info("batch partitions owned: %s", sorted(self.owned))

    def _on_revoke(self, consumer, parts) -> None:
        lost = {p.partition for p in parts}
        self.owned -= lost
        for batch_id in [b for b in self.runs if self.store.partition_of(b) in lost]:
            self._drop(batch_id)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._group.poll(0)
                self._adopt()
                busy = self._read_answers()
                now = now_ms()
                for run in list(self.runs.values()):
                    self._step(run, now)
                if time.monotonic() - self._swept > _SWEEP_S:
                    self._sweep()
                if not busy:
                    time.sleep(0.05)
            except Exception:  # noqa: BLE001 (the batch goes on: the next turn tries again)
                log.exception("the batch driver failed a turn")
                time.sleep(1)

    # -- adopting ------------------------------------------------------------------------------

    def _adopt(self) -> None:
        for rec in self.store.all_batches():
            if rec.terminal or rec.id in self.runs or self.store.partition_of(rec.id) not in self.owned:
                continue
            try:
                self._adopt_one(rec)
            except LlmqError as exc:
                log.warning("batch %s: %s", rec.id, exc)

    def _adopt_one(self, rec: R.BatchRecord) -> None:
        try:
            data = self.store.read_file(rec.input_file_id)
        except LlmqError as exc:
            if self.store.file(rec.input_file_id) is None:
                return self._fail(rec, "file_not_found", f"the input file {rec.input_file_id} is gone")
            raise exc
        lines = parse_lines(data, rec.endpoint, self.settings.serve.default_max_tokens)
        if not lines:
            return self._fail(rec, "empty_file", "the input file has no lines")
        if rec.status == R.VALIDATING:
            rec.reply_partition = self.store.partition_of(rec.id) % self.settings.topics.response_partitions
            rec.answers_from = self._end(rec.reply_partition)
            rec.status, rec.in_progress_at, rec.total = R.IN_PROGRESS, int(time.time()), len(lines)
            rec.failed = sum(1 for line in lines if line.error is not None)
            self.store.put_batch(rec)  # durable before a line is sent
            log.info("batch %s: %d lines (%d invalid), band %s", rec.id, len(lines), rec.failed, rec.priority)
        progress = BatchProgress(rec.id, lines, rec.expires_at * 1000, self.cfg.max_outstanding)
        run = Run(rec, lines, progress, catch_up_to=self._end(rec.reply_partition))
        self._listen(rec.reply_partition, rec.answers_from)
        run.caught_up = run.catch_up_to <= rec.answers_from
        self.runs[rec.id] = run

    def _fail(self, rec: R.BatchRecord, code: str, message: str) -> None:
        rec.status, rec.failed_at = R.FAILED, int(time.time())
        rec.errors = [{"code": code, "message": message, "param": "input_file_id", "line": None}]
        self.store.put_batch(rec)

    def _end(self, partition: int) -> int:
        return self._answers.get_watermark_offsets(TopicPartition(self.responses, partition), timeout=10)[1]

    def _listen(self, partition: int, offset: int) -> None:
        tp = TopicPartition(self.responses, partition, offset)
        if partition not in self._assigned:
            self._answers.incremental_assign([tp])
            self._assigned.add(partition)
            return
        position = self._answers.position([TopicPartition(self.responses, partition)])[0].offset
        if position < 0 or position > offset:
            self._answers.seek(tp)

    def _drop(self, batch_id: str) -> None:
        """Stop driving a batch; a reply partition no other batch here reads is let go (reading
        it would decode every answer of the clients that share it)."""
        run = self.runs.pop(batch_id)
        partition = run.record.reply_partition
        if partition in self._assigned and all(r.record.reply_partition != partition for r in self.runs.values()):
            self._answers.incremental_unassign([TopicPartition(self.responses, partition)])
            self._assigned.discard(partition)

    # -- answers -------------------------------------------------------------------------------

    def _read_answers(self) -> bool:
        if not self._assigned:
            return False
        msgs = self._answers.consume(1000, 0.02)
        now = now_ms()
        for msg in msgs:
            if msg.error() is not None or msg.value() is None:
                continue
            try:
                resp = self.codec.decode_response(msg.value())
            except DecodeError:
                continue
            for run in self.runs.values():
                if run.progress.owns(resp.request_id):
                    run.progress.answer(resp, now)
                    break
        for run in self.runs.values():
            if not run.caught_up:
                tp = TopicPartition(self.responses, run.record.reply_partition)
                run.caught_up = self._answers.position([tp])[0].offset >= run.catch_up_to
                if run.caught_up and run.record.status == R.IN_PROGRESS:
                    run.progress.resubmit_all()
        return bool(msgs)

    # -- one turn of a batch ---------------------------------------------------------------------

    def _step(self, run: Run, now: int) -> None:
        if not run.caught_up:
            return
        rec, progress = run.record, run.progress
        if rec.status == R.IN_PROGRESS and self.store.cancel_asked(rec.id) is not None:
            self._cancel(run, now)
        if rec.status == R.CANCELLING:
            if not progress.outstanding or now >= run.cancel_until_ms:
                progress.close(CANCELLED_LINE, outstanding_too=True)
                return self._finalize(run, R.CANCELLED)
        elif rec.status == R.IN_PROGRESS:
            if now >= rec.expires_at * 1000:
                progress.close(EXPIRED_LINE, outstanding_too=now >= rec.expires_at * 1000 + _WINDOW_GRACE_MS)
            else:
                self._send(run, now)
            if progress.done:
                return self._finalize(run, R.EXPIRED if progress.any_expired() else R.COMPLETED)
        elif rec.status == R.FINALIZING and progress.done:
            return self._finalize(run, R.EXPIRED if progress.any_expired() else R.COMPLETED)
        elif rec.status == R.FINALIZING:
            progress.resubmit_all()
            rec.status = R.IN_PROGRESS
        self._publish(run, now)

    def _cancel(self, run: Run, now: int) -> None:
        rec = run.record
        rec.status, rec.cancelling_at = R.CANCELLING, int(time.time())
        run.cancel_until_ms = now + int(self.cfg.cancel_grace_s * 1000)
        for index in run.progress.close(CANCELLED_LINE, outstanding_too=False):
            self.client.engine.cancel(run.progress.request_id(index), "the batch was cancelled")
        self.store.put_batch(rec)
        log.info("batch %s: cancelling, %d lines still running", rec.id, len(run.progress.outstanding))

    def _send(self, run: Run, now: int) -> None:
        rec = run.record
        band = Priority.parse(rec.priority)
        tenant = self.registry.get(rec.tenant)
        tier = tenant.tier if tenant is not None else "standard"
        timeout = min(self.cfg.line_timeout_ms, rec.expires_at * 1000 - now)
        if timeout <= 0:
            return
        for index in run.progress.to_submit(now):
            line = run.lines[index]
            fields = dict(line.parsed.fields)
            prompt = fields.pop("prompt")
            meta = {**fields.pop("metadata", {}), "batch_id": rec.id, "custom_id": line.custom_id}
            req = Request.new(rec.tenant, prompt, priority=band, model=line.parsed.model, timeout_ms=timeout,
                              request_id=run.progress.request_id(index), user_tier=tier, metadata=meta,
                              reply_partition=rec.reply_partition, **fields)
            try:
                self.client.submit_nowait(req, track=False)
            except EncodeError as exc:
                run.progress.settle(index, Verdict("invalid_request", exc.refusal))

    def _publish(self, run: Run, now: int, force: bool = False) -> None:
        counts = run.progress.counts()
        if not force and (counts == run.published or now - run.published_ms < self.cfg.progress_interval_ms):
            return
        rec = run.record
        rec.total, rec.completed, rec.failed = counts
        self.store.put_batch(rec)
        run.published, run.published_ms = counts, now

    def _finalize(self, run: Run, status: str) -> None:
        rec, progress = run.record, run.progress
        rec.status, rec.finalizing_at = R.FINALIZING, rec.finalizing_at or int(time.time())
        self._publish(run, now_ms(), force=True)
        outputs, errors = [], []
        for line in run.lines:
            final = progress.final[line.index]
            if isinstance(final, Response):
                doc = output_line(line, final, rec.endpoint)
                (outputs if doc["response"]["status_code"] == 200 else errors).append(doc)
            else:
                errors.append(error_line(line, progress.request_id(line.index), final.code, final.message))
        rec.output_file_id = self._result_file(rec, "output", outputs)
        rec.error_file_id = self._result_file(rec, "error", errors)
        rec.status = status
        stamp = int(time.time())
        if status == R.COMPLETED:
            rec.completed_at = stamp
        elif status == R.EXPIRED:
            rec.expired_at = stamp
        else:
            rec.cancelled_at = stamp
        self.store.put_batch(rec)
        self._drop(rec.id)
        log.info("batch %s: %s, %d completed, %d failed of %d", rec.id, status, rec.completed, rec.failed, rec.total)

    def _result_file(self, rec: R.BatchRecord, kind: str, docs: list[dict]) -> str | None:
        if not docs:
            return None
        data = jsonl(docs)
        file_id = R.result_file_id(rec.id, kind)
        self.store.put_file(R.FileRecord(file_id, rec.tenant, f"{rec.id}_{kind}.jsonl", "batch_output", len(data),
                                         int(time.time()), 0, len(docs), rec.id), self.store.chunks_of(data))
        return file_id

    def _sweep(self) -> None:
        """Finished batches past batch.retention_s go, with their output and error files."""
        self._swept = time.monotonic()
        horizon = time.time() - self.cfg.retention_s
        for rec in self.store.all_batches():
            ended = rec.ended_at
            if ended is None or ended > horizon or self.store.partition_of(rec.id) not in self.owned:
                continue
            for file_id in (rec.output_file_id, rec.error_file_id):
                if file_id:
                    self.store.delete_file(file_id)
            self.store.delete_batch(rec.id)
            log.info("batch %s: deleted, %d s after it ended", rec.id, self.cfg.retention_s)
