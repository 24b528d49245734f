"""The chaos harness's traffic and its reader: what clients send and what they are answered.

* :class:`Pacer`: any Kafka client (a plain librdkafka producer) writing requests at a steady rate.
* :class:`SdkCallers`: threads of ``LlmqClient.submit_and_wait``, one call at a time each.
* :class:`ServeCallers`: threads calling ``llmq serve``'s chat endpoint, as an OpenAI client
  would, retrying a 503 after its ``Retry-After`` until the call's own deadline.
* :class:`ResponseCounter`: every answer on the response topic as a read_committed reader sees it.
* :func:`locate`: where the requests that reader saw no answer to are.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from dataclasses import dataclass, field

import httpx
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from pipeline.client import LlmqClient
from pipeline.config import Settings
from pipeline.errors import LlmqError
from pipeline.models import Priority, Request
from pipeline.serde import Codec
from pipeline.worker.backends.simulated import LATENCY_METADATA_KEY

#: How long a serve call may outlast its deadline before it counts as hung: serve's own margin
#: (2 s) and the time an answer takes to travel.
HUNG_MARGIN_S = 5.0


class Pacer(threading.Thread):
    """Writes ``n`` requests over 20 tenants and every band at ``rate`` a second; the first
    ``slow_calls`` outlast max.poll.interval.ms in the model."""

    def __init__(self, settings: Settings, n: int, rate: float, slow_calls: int, slow_ms: int):
        super().__init__(name="pacer", daemon=True)
        self.settings, self.n, self.rate = settings, n, rate
        self.slow_calls, self.slow_ms = slow_calls, slow_ms
        self.ids: list[str] = []
        self.undelivered: list[str] = []

    def run(self) -> None:
        codec = Codec.default()
        # Any Kafka client, as its users configure it: records not acknowledged within two minutes
        # are reported to the writer (and counted apart) rather than held for librdkafka's five.
        producer = Producer(self.settings.kafka.producer_config(**{"linger.ms": 5, "log_level": 2,
                                                                   "message.timeout.ms": 120_000}))
        t0 = time.monotonic()
        for i in range(self.n):
            delay = t0 + i / self.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            metadata = {LATENCY_METADATA_KEY: str(self.slow_ms)} if i < self.slow_calls else {}
            req = Request.new(f"tenant-{i % 20}", f"chaos request {i}", priority=list(Priority)[i % 5],
                              max_tokens=8, timeout_ms=600_000, metadata=metadata)
            self.ids.append(req.request_id)
            value, key = codec.encode_request(req), req.tenant_id.encode()
            rid = req.request_id
            while True:
                try:
                    producer.produce(self.settings.topics.request_topic(req.priority), value, key,
                                     on_delivery=lambda err, msg, rid=rid: err and self.undelivered.append(rid))
                    break
                except BufferError:
                    producer.poll(0.1)
            producer.poll(0)
        # librdkafka retries through leader changes and a cluster restart (the project's
        # producer defaults: idempotent, acks=all); a request it gives up on was never
        # acknowledged, so the writer knows: it is counted apart, not as lost.
        producer.flush(300)


@dataclass
class CallLog:
    """What callers of one kind saw."""

    completed: list[str] = field(default_factory=list)  # request ids answered COMPLETED
    other: collections.Counter = field(default_factory=collections.Counter)  # any other outcome
    retried_503: int = 0
    not_taken: int = 0  # a submit Kafka did not acknowledge in time (nothing was queued)
    hung: list[float] = field(default_factory=list)  # seconds past the deadline, for calls that outlasted it
    longest_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, ok: bool, outcome: str, request_id: str, took: float, deadline_s: float) -> None:
        """One call's end: answered (its request id kept) or not (its outcome counted), and how
        long it took against its deadline."""
        with self.lock:
            self.longest_s = max(self.longest_s, took)
            if took > deadline_s + HUNG_MARGIN_S:
                self.hung.append(took - deadline_s)
            if ok:
                self.completed.append(request_id)
            else:
                self.other[outcome] += 1

    def summary(self) -> dict:
        return {"completed": len(self.completed), "other": dict(self.other), "retried_after_503": self.retried_503,
                "not_taken": self.not_taken, "past_deadline": len(self.hung),
                "longest_call_s": round(self.longest_s, 1)}


class SdkCallers:
    """``threads`` SDK callers, each waiting for one answer at a time (deadline ``deadline_s``)."""

    def __init__(self, settings: Settings, threads: int = 2, deadline_s: float = 120.0):
        self.settings, self.deadline_s = settings, deadline_s
        self.log = CallLog()
        self.submitted: list[str] = []
        self._stop = threading.Event()
        self.client = LlmqClient(settings, reply_partitions=[1])
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _run(self, index: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            req = Request.new("chaos-sdk", f"sdk {index}-{i}", max_tokens=8, timeout_ms=int(self.deadline_s * 1000))
            started = time.monotonic()
            try:
                self.client.submit(req, timeout=30.0, wait_queued=0)
            except LlmqError:
                with self.log.lock:
                    self.log.not_taken += 1
                continue
            with self.log.lock:
                self.submitted.append(req.request_id)
            try:
                # The pipeline answers EXPIRED at the deadline: waiting a little past it tells a
                # late answer (counted past the deadline) from none.
                resp = self.client.result(req.request_id, timeout=self.deadline_s + HUNG_MARGIN_S + 10)
                outcome = resp.status.value
            except LlmqError as exc:
                outcome = type(exc).__name__
            self.log.record(outcome == "COMPLETED", outcome, req.request_id, time.monotonic() - started,
                            self.deadline_s)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.deadline_s + 30)
        self.client.close()


class ServeCallers:
    """``threads`` callers of ``llmq serve``'s /v1/chat/completions with ``api_key``: a 503 is
    retried after its Retry-After while the call's deadline allows, like a careful OpenAI client."""

    def __init__(self, url: str, api_key: str, threads: int = 2, deadline_s: float = 60.0):
        self.url, self.api_key, self.deadline_s = url, api_key, deadline_s
        self.log = CallLog()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _run(self, index: int) -> None:
        http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.api_key}"})
        i = 0
        while not self._stop.is_set():
            i += 1
            started = time.monotonic()
            outcome, request_id = self._call(http, f"serve {index}-{i}", started)
            self.log.record(outcome == "200", outcome, request_id, time.monotonic() - started, self.deadline_s)
        http.close()

    def _call(self, http: httpx.Client, prompt: str, started: float) -> tuple[str, str]:
        body = {"model": "sim", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
        while True:
            left = self.deadline_s - (time.monotonic() - started)
            if left <= 0:
                return "gave up: deadline passed while retrying 503s", ""
            try:
                r = http.post("/v1/chat/completions", json=body, timeout=left + HUNG_MARGIN_S + 5,
                              headers={"x-llmq-timeout-ms": str(int(left * 1000))})
            except httpx.HTTPError as exc:
                # serve itself unreachable: not what this harness injects.
                return f"http error {type(exc).__name__}", ""
            if r.status_code == 503 and not self._stop.is_set():
                with self.log.lock:
                    self.log.retried_503 += 1
                time.sleep(min(float(r.headers.get("Retry-After", "1")), max(0.0, left)))
                continue
            return str(r.status_code), r.headers.get("x-llmq-request-id", "")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.deadline_s + 30)


class ResponseCounter(threading.Thread):
    """Counts responses per request id as a read_committed consumer sees them, while faults happen."""

    def __init__(self, settings: Settings):
        super().__init__(name="response-counter", daemon=True)
        self.settings = settings
        self.counts: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[str] = collections.Counter()
        #: every status each request id was answered with
        self.by_id: collections.defaultdict[str, set[str]] = collections.defaultdict(set)
        self._stop_event = threading.Event()
        self.last_progress = time.monotonic()

    def run(self) -> None:
        codec = Codec.default()
        consumer = Consumer({"bootstrap.servers": self.settings.kafka.bootstrap, "log_level": 2,
                             "group.id": f"chaos-reader-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
                             "isolation.level": "read_committed", "auto.offset.reset": "earliest"})
        topic = self.settings.topics.responses
        parts = consumer.list_topics(topic, timeout=60).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        try:
            while not self._stop_event.is_set():
                for msg in consumer.consume(1000, 0.2):
                    if msg.error() is not None:
                        continue
                    resp = codec.decode_response(msg.value())
                    if not resp.status.is_terminal:
                        continue
                    self.counts[resp.request_id] += 1
                    self.statuses[resp.status.value] += 1
                    self.by_id[resp.request_id].add(resp.status.value)
                    self.last_progress = time.monotonic()
        finally:
            consumer.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)

    def settle(self, quiet_s: float = 3.0) -> "ResponseCounter":
        """Wait until this (fresh) reader has read what there is to read."""
        time.sleep(1)
        while True:
            before = sum(self.counts.values())
            time.sleep(quiet_s)
            if sum(self.counts.values()) == before:
                return self


def fresh_counter(settings: Settings, old: ResponseCounter) -> ResponseCounter:
    """A new reader from the start of the response topic in place of ``old``."""
    fresh = ResponseCounter(settings)
    fresh.start()
    old.stop()
    return fresh


def _read_all(settings: Settings, topic: str, isolation: str, timeout_s: float = 60.0) -> list:
    """Every record of ``topic`` up to its end as ``isolation`` sees it: ``[(partition, value)]``."""
    consumer = Consumer({"bootstrap.servers": settings.kafka.bootstrap, "log_level": 2,
                         "group.id": f"chaos-locate-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
                         "isolation.level": isolation, "enable.partition.eof": True})
    try:
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        out, ended, deadline = [], set(), time.monotonic() + timeout_s
        while len(ended) < len(parts) and time.monotonic() < deadline:
            for msg in consumer.consume(1000, 0.5):
                if msg.error() is None:
                    out.append((msg.partition(), msg.value()))
                elif msg.error().code() == KafkaError._PARTITION_EOF:
                    ended.add(msg.partition())
        return out
    finally:
        consumer.close()


def locate(settings: Settings, ids: set[str]) -> dict:
    """Where requests a read_committed reader saw no answer to are: answered but only visible
    read_uncommitted (behind an open or aborted transaction), dispatched (committed, or only
    uncommitted), or still in a request topic. And per response partition, how far the last
    stable offset stands behind the end (an open transaction holds read_committed readers there)."""
    codec, topics = Codec.default(), settings.topics
    where = dict.fromkeys(ids, "nowhere")
    # Each id ends at the furthest place it was found (read_uncommitted sees committed records too).
    rank = {label: i for i, label in enumerate(("nowhere", "in a request topic", "dispatched, only uncommitted",
                                                "dispatched", "answered, only uncommitted"))}

    def mark(topic_names, decode, label, isolation):
        for topic in topic_names:
            for _, value in _read_all(settings, topic, isolation):
                try:
                    rid = decode(value).request_id
                except Exception:  # noqa: BLE001 (a dead letter's bytes, say: not ours to place)
                    continue
                if rid in where and rank[label] > rank[where[rid]]:
                    where[rid] = label

    mark(topics.request_topics, codec.decode_request, "in a request topic", "read_uncommitted")
    mark(topics.dispatch_topics, codec.decode_request, "dispatched, only uncommitted", "read_uncommitted")
    mark(topics.dispatch_topics, codec.decode_request, "dispatched", "read_committed")
    mark([topics.responses], codec.decode_response, "answered, only uncommitted", "read_uncommitted")
    gaps = {}
    probe = {iso: Consumer({"bootstrap.servers": settings.kafka.bootstrap, "group.id": f"chaos-lso-{iso}",
                            "isolation.level": iso}) for iso in ("read_committed", "read_uncommitted")}
    try:
        parts = probe["read_committed"].list_topics(topics.responses, timeout=30).topics[topics.responses].partitions
        for p in parts:
            tp = TopicPartition(topics.responses, p)
            stable = probe["read_committed"].get_watermark_offsets(tp, timeout=10)[1]
            end = probe["read_uncommitted"].get_watermark_offsets(tp, timeout=10)[1]
            if end > stable:
                gaps[p] = end - stable
    finally:
        for c in probe.values():
            c.close()
    return {"unanswered_where": dict(collections.Counter(where.values())), "responses_behind_open_transactions": gaps}
