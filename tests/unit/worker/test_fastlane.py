"""The worker's fast lane (``_lane.c``) answers exactly as the Python path would.

Each test runs the same consumed messages through two workers, one with the lane and one
without, and compares what they publish, their metrics, their offsets and their counts.
Driven without a broker: the fake producer acknowledges at once.
"""

from __future__ import annotations

import math
import random
import uuid
import zlib

import pytest

from pipeline import models
from pipeline.config import Settings
from pipeline.dlq import H_FAILED_AT
from pipeline.models import Priority, Request, Status
from pipeline.observability.metrics import _Series
from pipeline.serde import Codec, fastpath
from pipeline.testing import FakeMessage, avro_string
from pipeline.worker import fastlane
from pipeline.worker import loop as worker_loop
from pipeline.worker.backends.simulated import SimulatedBackend, expected_output
from pipeline.worker.fastlane import FastLane
from pipeline.worker.loop import Worker
from tests.unit.worker.test_admission_fuzz import FakeProducer

built = pytest.mark.skipif(not (fastlane.lane_available() and fastpath.native_available()),
                           reason="the C extensions are not built (no C compiler?)")

CODEC = Codec.default()
NOW = 1_800_000_000_000


pytestmark = built


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    # Both paths stamp started_at/finished_at from the clock: one value makes them comparable.
    monkeypatch.setattr(worker_loop, "_now_ms", lambda: NOW)
    monkeypatch.setattr(models, "now_ms", lambda: NOW)


def _worker(lane: bool, cancelled: dict | None = None) -> Worker:
    worker = Worker(Settings.load(env={}), SimulatedBackend(), worker_id="lane-test")
    worker.producer = FakeProducer()
    if lane:
        worker._lane = FastLane.build(codec=worker.codec, wire=worker._wire, backend=worker.backend,
                                      worker_id=worker.worker_id, seen=worker._seen, cancelled=cancelled)
        assert worker._lane is not None
    return worker


def _feed(worker: Worker, msgs: list, lane: bool) -> None:
    # as the worker's loop: the batch in, then a dispatch of whatever reached the band queues
    if lane:
        worker._run_lane(list(msgs))
    else:
        worker._take_many(list(msgs))
    while worker._dispatch():
        pass


def _request(i: int, **fields) -> Request:
    base = dict(priority=Priority.NORMAL, max_tokens=16, timeout_ms=60_000, created_at=NOW - 40 - i,
                request_id=str(uuid.UUID(int=i + 1)))
    base.update(fields)
    tenant = base.pop("tenant_id", f"tenant-{i % 7}")
    prompt = base.pop("prompt", f"prompt number {i} " * (1 + i % 5))
    return Request.new(tenant, prompt, **base)


def _metrics(worker: Worker) -> dict:
    out = {}
    for name, series in vars(worker.metrics).items():
        if not isinstance(series, _Series):
            continue
        for labels, child in series.children.items():
            if hasattr(child, "counts"):
                out[(name, labels)] = (tuple(child.counts), round(child.sum, 6))
            else:
                out[(name, labels)] = round(child.value, 6)
    return out


def _published(worker: Worker) -> dict:
    # Per topic: the Python path writes a chunk's dead letters as it decodes it, before the
    # answers of the messages ahead of them; only the order within a topic is promised.
    out: dict = {}
    for m in worker.producer.sent:
        headers = [(k, v) for k, v in m.headers() or [] if k != H_FAILED_AT]  # a clock reading
        out.setdefault(m.topic(), []).append((m.value(), m.key(), headers))
    return out


def _both(msgs: list, cancelled: dict | None = None) -> tuple[Worker, Worker]:
    python, lane = _worker(False), _worker(True, cancelled)
    if cancelled:
        for worker in (python, lane):
            worker.cancellations = type("View", (), {"reason": staticmethod(cancelled.get)})()
    _feed(python, msgs, False)
    _feed(lane, msgs, True)
    return python, lane


def _assert_same(python: Worker, lane: Worker) -> None:
    decoded = [[CODEC.decode_response(m.value()) for m in w.producer.sent if m.topic() == w.responses_topic]
               for w in (lane, python)]
    assert decoded[0] == decoded[1]  # readable first, then to the byte
    assert _published(lane) == _published(python)
    assert _metrics(lane) == _metrics(python)
    assert lane.tracker.to_commit_with_done() == python.tracker.to_commit_with_done()
    assert lane.stats.consumed == python.stats.consumed
    for field in ("completed", "failed", "expired", "rejected", "cancelled", "dead_lettered"):
        assert getattr(lane.stats, field) == getattr(python.stats, field), field
    assert lane._seen == python._seen
    assert list(lane._seen_order) == list(python._seen_order)


def _msgs(values: list, topic: str, partition: int = 0) -> list[FakeMessage]:
    return [FakeMessage(topic, partition, offset, value, b"key") for offset, value in enumerate(values)]


def _normal_topic() -> str:
    return Settings.load(env={}).topics.request_topic(Priority.NORMAL)


def test_crc32_is_zlibs():
    rng = random.Random(7)
    for size in (0, 1, 7, 8, 9, 63, 512, 1000):
        data = bytes(rng.randrange(256) for _ in range(size))
        for seed in (0, 1, 0xFFFFFFFF, 123456789):
            assert fastlane._lane.crc32(data, seed) == zlib.crc32(data, seed)


def test_ordinary_requests_are_answered_byte_for_byte_as_by_the_python_path():
    requests = [_request(i) for i in range(200)]
    python, lane = _both(_msgs([CODEC.encode_request(r) for r in requests], _normal_topic()))
    _assert_same(python, lane)
    answers = [CODEC.decode_response(m.value()) for m in lane.producer.sent]
    assert [a.status for a in answers] == [Status.COMPLETED] * 200
    assert [a.output for a in answers] == [expected_output(r) for r in requests]
    assert lane.tracker.to_commit() == [((_normal_topic(), 0), 200)]


def test_every_unusual_message_takes_the_python_path_in_its_place():
    first = _request(0)
    unusual = [
        CODEC.encode_request(first),
        CODEC.encode_request(first),  # the same id again: rejected as a duplicate
        b"\x00not avro at all",  # dead letter
        b"",  # empty value: dead letter
        CODEC.encode_request(_request(1, tenant_id="")),  # invalid: empty tenant
        CODEC.encode_request(_request(2, tenant_id="   ")),  # invalid: blank tenant
        CODEC.encode_request(_request(3, tenant_id="tenant-é")),  # valid, but not ASCII: Python decides
        CODEC.encode_request(_request(4, tenant_id="t" * 257)),  # too long
        CODEC.encode_request(_request(5, request_id="not-a-uuid")),
        CODEC.encode_request(_request(6, trace_id="trace-1.2:3_x")),  # valid trace id: copied to metadata
        CODEC.encode_request(_request(7, trace_id="bad trace")),
        CODEC.encode_request(_request(8, created_at=NOW - 120_000, timeout_ms=1_000)),  # expired
        CODEC.encode_request(_request(9, created_at=NOW + 3_600_000)),  # from the future
        CODEC.encode_request(_request(10, max_tokens=0)),
        CODEC.encode_request(_request(11, max_tokens=2_000_000)),
        CODEC.encode_request(_request(12, max_tokens=1)),
        CODEC.encode_request(_request(13, max_tokens=500)),  # more than the model says: capped
        CODEC.encode_request(_request(14, metadata={"k": "v"})),  # metadata: Python decides
        CODEC.encode_request(_request(15, admitted_at=NOW - 5, effective_priority=Priority.HIGH,
                                      degraded_from="sim-large")),  # the gateway's fields
        CODEC.encode_request(_request(16, model="")),
        CODEC.encode_request(_request(17, user_tier="gold", allow_degrade=True)),
        CODEC.encode_request(_request(18, priority=Priority.CRITICAL)),  # a priority other than the topic's
        CODEC.encode_request(_request(19, created_at=NOW - 3_000)),  # waited 3 s
    ]
    values = unusual + [CODEC.encode_request(_request(100 + i)) for i in range(20)]
    python, lane = _both(_msgs(values, _normal_topic()))
    _assert_same(python, lane)
    statuses = [CODEC.decode_response(m.value()).status for m in lane.producer.sent if m.topic() == lane.responses_topic]
    assert statuses.count(Status.COMPLETED) == 30
    assert lane.stats.dead_lettered == 2


def test_a_duplicate_behind_an_expired_request_is_judged_as_one_by_one():
    expired = _request(1, created_at=NOW - 120_000, timeout_ms=1_000)
    again = _request(2, request_id=expired.request_id)  # same id, fresh: a duplicate of the expired one
    python, lane = _both(_msgs([CODEC.encode_request(expired), CODEC.encode_request(again)], _normal_topic()))
    _assert_same(python, lane)
    statuses = [CODEC.decode_response(m.value()).status for m in lane.producer.sent]
    assert statuses == [Status.EXPIRED, Status.REJECTED]


def test_cancelled_requests_are_left_to_the_python_path():
    requests = [_request(i) for i in range(5)]
    cancelled = {requests[2].request_id: "user pressed stop"}
    python, lane = _both(_msgs([CODEC.encode_request(r) for r in requests], _normal_topic()), cancelled)
    _assert_same(python, lane)
    statuses = [CODEC.decode_response(m.value()).status for m in lane.producer.sent]
    assert statuses == [Status.COMPLETED, Status.COMPLETED, Status.CANCELLED, Status.COMPLETED, Status.COMPLETED]


def test_random_mixtures_match_the_python_path():
    rng = random.Random(20261130)
    for round_ in range(20):
        values = []
        for i in range(rng.randrange(1, 120)):
            kind = rng.random()
            r = _request(round_ * 1000 + i, tenant_id=f"tenant-{rng.randrange(30)}",
                         max_tokens=rng.choice([1, 5, 16, 64]), created_at=NOW - rng.randrange(0, 700_000))
            if kind < 0.05:
                values.append(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))))
            elif kind < 0.1 and values:
                values.append(rng.choice(values))  # a repeat
            else:
                values.append(CODEC.encode_request(r))
        python, lane = _both(_msgs(values, _normal_topic()))
        _assert_same(python, lane)


def test_runs_of_several_partitions_commit_like_the_python_path():
    topic = _normal_topic()
    msgs = []
    for p in range(3):
        msgs += [FakeMessage(topic, p, 10 + o, CODEC.encode_request(_request(p * 100 + o)), b"k") for o in range(30)]
    python, lane = _both(msgs)
    # The Python path serves the partitions in turn, the lane in consumption order: the same
    # answers, in another order.
    assert sorted(_published(lane)[lane.responses_topic]) == sorted(_published(python)[python.responses_topic])
    assert _metrics(lane) == _metrics(python)
    assert sorted(lane.tracker.to_commit()) == sorted(python.tracker.to_commit()) == [
        ((topic, 0), 40), ((topic, 1), 40), ((topic, 2), 40)]


def test_a_batch_of_several_bands_goes_to_the_band_queues_and_their_scheduler():
    settings = Settings.load(env={})
    low = [FakeMessage(settings.topics.request_topic(Priority.LOW), 0, o,
                       CODEC.encode_request(_request(o, priority=Priority.LOW)), b"k") for o in range(3)]
    critical = [FakeMessage(settings.topics.request_topic(Priority.CRITICAL), 0, o,
                            CODEC.encode_request(_request(50 + o, priority=Priority.CRITICAL)), b"k") for o in range(3)]
    twin = CODEC.encode_request(_request(99, priority=Priority.CRITICAL, request_id=str(uuid.UUID(int=1))))
    critical.append(FakeMessage(settings.topics.request_topic(Priority.CRITICAL), 0, 3, twin, b"k"))
    python, lane = _worker(False), _worker(True)
    for worker in (python, lane):
        worker._scheduler.record_many(0, 150)  # CRITICAL has had most of the recent turns
    _feed(python, low + critical, False)
    _feed(lane, low + critical, True)
    _assert_same(python, lane)
    assert list(lane._scheduler._recent) == list(python._scheduler._recent)


def test_messages_left_to_the_python_path_count_for_the_band_shares():
    values = [CODEC.encode_request(_request(0)), b"\x00junk", CODEC.encode_request(_request(1, tenant_id="")),
              CODEC.encode_request(_request(2, metadata={"k": "v"})), CODEC.encode_request(_request(3))]
    python, lane = _both(_msgs(values, _normal_topic()))
    _assert_same(python, lane)
    assert list(lane._scheduler._recent) == list(python._scheduler._recent) == [Priority.NORMAL.rank] * 5


def test_a_deadline_past_int64_is_no_deadline_as_in_python():
    values = [CODEC.encode_request(_request(0, timeout_ms=2 ** 63 - 1)),
              CODEC.encode_request(_request(1, created_at=-(2 ** 62), timeout_ms=1)),  # long expired
              CODEC.encode_request(_request(2, created_at=-(2 ** 63), timeout_ms=2 ** 63 - 1))]
    python, lane = _both(_msgs(values, _normal_topic()))
    _assert_same(python, lane)
    assert [CODEC.decode_response(m.value()).status for m in lane.producer.sent] == [
        Status.COMPLETED, Status.EXPIRED, Status.EXPIRED]


def test_not_used_where_it_could_change_an_outcome():
    worker = Worker(Settings.load(env={}), SimulatedBackend(latency_ms=5), worker_id="w")
    build = dict(codec=worker.codec, wire="single-object", worker_id="w", seen=set(), cancelled=None)
    assert FastLane.build(backend=SimulatedBackend(latency_ms=5), **build) is None
    assert FastLane.build(backend=SimulatedBackend(ms_per_token=1), **build) is None
    assert FastLane.build(backend=SimulatedBackend(), **{**build, "wire": "confluent"}) is None
    assert FastLane.build(backend=SimulatedBackend(), **build) is not None


def test_exactly_once_answers_wait_for_the_transaction_as_the_python_paths_do():
    values = [CODEC.encode_request(_request(i)) for i in range(50)]
    values[7] = CODEC.encode_request(_request(7, tenant_id="tenant-ü"))  # via the Python path
    values[9] = b"\x00garbage"  # a dead letter
    python, lane = _worker(False), _worker(True)
    for worker in (python, lane):
        worker.exactly_once = True
    msgs = _msgs(values, _normal_topic())
    _feed(python, msgs, False)
    _feed(lane, msgs, True)
    assert lane.producer.sent == [] and python.producer.sent == []  # nothing outside a transaction

    def ready(worker):
        return {tp: {off: (topic, value, key, [(k, v) for k, v in headers or [] if k != H_FAILED_AT])
                     for off, (topic, value, key, headers) in part.items()}
                for tp, part in worker._ready.items()}

    assert ready(lane) == ready(python)
    assert len(ready(lane)[(_normal_topic(), 0)]) == 50
    assert lane.tracker.to_commit() == python.tracker.to_commit() == [((_normal_topic(), 0), 50)]
    assert _metrics(lane) == _metrics(python)


def test_lane_off_by_environment(monkeypatch):
    monkeypatch.setenv("LLMQ_FAST_LANE", "0")
    assert not fastlane.lane_available()


def test_a_full_worker_hands_the_rest_to_the_band_queues():
    worker = _worker(True)
    worker.cfg.max_inflight = 1
    worker._tasks[("busy", 0)] = object()  # every slot taken
    topic = _normal_topic()
    values = [CODEC.encode_request(_request(0)), CODEC.encode_request(_request(1, metadata={"k": "v"})),
              CODEC.encode_request(_request(2))]
    worker._run_lane(_msgs(values, topic))
    # The first is answered in the lane; the second would need the Python path, and waits
    # for a slot with the one behind it, in order.
    assert len(worker.producer.sent) == 1
    assert worker._backlog[Priority.NORMAL.rank].size == 2


def test_label_n_counts_like_label_one_by_one_and_labels_alike_outside_a_ranking():
    from pipeline.observability.metrics import BoundedLabels

    one, many = BoundedLabels(top_n=3), BoundedLabels(top_n=3)
    stream = [f"t{i % 5}" for i in range(37)] + ["t9"] * 2000 + ["t1"] * 50
    for value in stream:
        one.label(value)
    for value in dict.fromkeys(stream):
        many.label_n(value, stream.count(value))
    assert sum(one._counts.values()) + len(one._pending) == sum(many._counts.values()) + many._counted
    # Between rankings the labels are the same: room in the top-N, or already in it.
    a, b = BoundedLabels(top_n=3), BoundedLabels(top_n=3)
    for value, count in (("x", 10), ("y", 20), ("x", 5), ("z", 1), ("w", 7)):
        assert {a.label(value) for _ in range(count)} == {b.label_n(value, count)}


def test_band_scheduler_record_many_is_record_repeated():
    from pipeline.policy.bands import BandScheduler

    rng = random.Random(3)
    for _ in range(50):
        a, b = BandScheduler([0.05, 0.05, 0.05, 0.05, 0.05], window=20), BandScheduler([0.05] * 5, window=20)
        for _ in range(30):
            band, count = rng.randrange(5), rng.randrange(0, 45)
            for _ in range(count):
                a.record(band)
            b.record_many(band, count)
            assert list(a._recent) == list(b._recent) and a._counts == b._counts


def test_prompts_and_models_in_any_script_are_answered_in_the_lane_as_by_python():
    prompts = ["héllo wörld", "日本語のプロンプト", "emoji 🙂 and more 🚀", "mixed ascii then ü" * 9, "\u0000nul inside"]
    requests = [_request(i, prompt=p, model=m) for i, (p, m) in
                enumerate((p, m) for p in prompts for m in ("sim-small", "modèle-ü"))]
    msgs = _msgs([CODEC.encode_request(r) for r in requests], _normal_topic())
    python, lane = _worker(False), _worker(True)
    lane._handle = lambda msg: pytest.fail(f"offset {msg.offset()} left the lane")
    _feed(python, msgs, False)
    _feed(lane, msgs, True)
    _assert_same(python, lane)
    answers = [CODEC.decode_response(m.value()) for m in lane.producer.sent]
    assert [a.prompt_tokens for a in answers] == [(len(r.prompt) + 3) // 4 or 1 for r in requests]


def test_mutilated_requests_are_judged_as_the_python_path_judges_them():
    """Flipped, inserted and dropped bytes anywhere in a request: whatever the Python path
    makes of it (a dead letter, a rejection, an answer), the lane's worker does the same."""
    rng = random.Random(11)
    for round_ in range(30):
        values = []
        for i in range(60):
            r = _request(round_ * 100 + i, prompt=rng.choice(["plain", "ünïcödé", "日本", "x" * 300]),
                         trace_id=rng.choice([None, "t-1", "tr:ace.2"]))
            data = bytearray(CODEC.encode_request(r))
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                at = rng.randrange(10, len(data))  # past the header: the body is what is read in place
                kind = rng.random()
                if kind < 0.6:
                    data[at] = rng.randrange(256)
                elif kind < 0.8:
                    data.insert(at, rng.randrange(256))
                else:
                    del data[at]
            values.append(bytes(data))
        python, lane = _both(_msgs(values, _normal_topic()))
        _assert_same(python, lane)


def test_strict_utf8_as_the_decoder():
    good = ["a", "é", "€", "𐍈", "\u07ff", "\uffff", "\U0010ffff", "\ud7ff", "\ue000"]
    bad = [b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf0\x80\x80\x80", b"\xf4\x90\x80\x80",
           b"\xf5\x80\x80\x80", b"\x80", b"\xc3", b"\xe2\x82", b"\xff"]
    prompts = [g.encode() for g in good] + bad
    values = []
    for i, raw in enumerate(prompts):
        # The prompt is the 4th field: write the request with a placeholder and swap its bytes in.
        placeholder = "P" * 7
        data = CODEC.encode_request(_request(i, prompt=placeholder))
        marker = bytes([len(placeholder) * 2]) + placeholder.encode()
        assert data.count(marker) == 1
        values.append(data.replace(marker, avro_string(raw)))
    python, lane = _both(_msgs(values, _normal_topic()))
    _assert_same(python, lane)
    assert lane.stats.completed == len(good) and lane.stats.dead_lettered == len(bad)



class _FlakyProducer(FakeProducer):
    """Refuses every third produce with BufferError (queue full) and fails every answer's
    first delivery, acknowledging the retry."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.failed_once: set = set()

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None, **_):
        self.calls += 1
        if self.calls % 3 == 0:
            raise BufferError("queue full")
        if value not in self.failed_once and on_delivery is not None:
            self.failed_once.add(value)
            on_delivery(_Err(), FakeMessage(topic, 0, -1, value, key, headers))
            return
        super().produce(topic, value, key, headers, on_delivery)

    def poll(self, timeout=0):
        return 0


class _Err:
    def code(self):
        return -1

    def fatal(self):
        return False

    def str(self):
        return "transient"

    def __str__(self):
        return "transient"


def test_refused_produces_and_failed_deliveries_are_retried_and_counted_once():
    values = [CODEC.encode_request(_request(i)) for i in range(40)]
    worker = _worker(True)
    worker.producer = _FlakyProducer()
    _feed(worker, _msgs(values, _normal_topic()), True)
    sent = [m.value() for m in worker.producer.sent]
    assert len(sent) == len(set(sent)) == 40  # each answer acknowledged once, none lost
    assert worker.stats.delivery_retries == 40
    assert worker.stats.delivered == 40
    assert worker.tracker.to_commit() == [((_normal_topic(), 0), 40)]


def test_countdown_counts_reports_down_and_hands_errors_on():
    calls = []
    countdown = fastlane._lane.Countdown(2, lambda: calls.append("done"), lambda e, m, cb: calls.append((e, m, cb)))
    countdown(None, "m1")
    assert countdown.left == 1 and calls == []
    countdown("err", "m2")
    assert calls == [("err", "m2", countdown)] and countdown.left == 1
    countdown(None, "m2")
    assert calls[-1] == "done" and countdown.left == 0
