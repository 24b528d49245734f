"""The gateway's admission lane (``_admit.c``) against the Python path: the same records through a
gateway with the lane and one without leave the same state and write the same bytes.

The records mix what the lane admits with everything it must leave to the Python path:
duplicates, cancellations, invalid and undecodable values, passed and urgent deadlines,
tiers, quotas and their demotions, rate limits per tenant and per tenant and model, tenants
with their own limits and caps, full queues, degradation under load, QUEUED notices.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from types import SimpleNamespace

import pytest

from pipeline.config import Settings
from pipeline import models
from pipeline.gateway import admitlane
from pipeline.gateway import app as gateway_app
from pipeline.gateway.app import Gateway
from pipeline.models import Priority, Request
from pipeline.serde import Codec

pytestmark = pytest.mark.skipif(not admitlane.lane_available(), reason="the C extensions are not built")


class RecordingProducer:
    def __init__(self, config):
        self.sent = []

    def produce(self, topic, value, key=None, headers=None, on_delivery=None, partition=None):
        self.sent.append((topic, value, key, partition, tuple(headers or ())))
        if on_delivery is not None:
            on_delivery(None, None)

    def poll(self, timeout=0):
        time.sleep(timeout)
        return 0

    def flush(self, timeout=0):
        return 0


class FakeAcks:
    def ack(self):
        pass


class Cancellations:
    """What the gateway reads of its CancellationView: reason(id) (Python path) and _ids (lane)."""

    def __init__(self, ids):
        self._ids = dict(ids)

    def reason(self, request_id):
        return self._ids.get(request_id)


def _settings() -> Settings:
    s = Settings.load(env={})
    g = s.gateway
    g.limits = {"per_second": {"window_ms": 1_000, "requests": 6, "tokens": 2_000},
                "per_minute_model": {"window_ms": 60_000, "requests": 40, "tokens": 50_000, "scope": "tenant_model"}}
    g.tenant_limits = {"own-limits": {"per_second": {"window_ms": 1_000, "requests": 2}}}
    g.tenant_outstanding = {"CRITICAL": 4, "HIGH": 0, "NORMAL": 5, "LOW": 0, "BACKGROUND": 0}
    g.tenant_outstanding_overrides = {"own-caps": {"NORMAL": 1}}
    g.queue_caps = {"CRITICAL": 0, "HIGH": 0, "NORMAL": 0, "LOW": 12, "BACKGROUND": 0}
    g.default_drain_rate = 60.0  # load passes 0.8 partway through: demotions and degradations
    g.state_flush_ms = 60_000
    return s


def _requests(rng: random.Random, now_ms: int, n: int, ordinary: float) -> list:
    tenants = ["acme", "zeta", "own-limits", "own-caps", "beta", "gamma", "ünï"]
    out = []
    for _ in range(n):
        if rng.random() < ordinary:  # what the lane admits, until a limit or cap says no
            out.append(Request.new(rng.choice(tenants[:2] + tenants[4:6]), "x" * rng.choice([1, 40, 400]),
                                   priority=rng.choice([Priority.CRITICAL, Priority.HIGH, Priority.NORMAL]),
                                   max_tokens=16, timeout_ms=600_000, created_at=now_ms,
                                   model=rng.choice(["sim-large", "other"])))
            continue
        req = Request.new(rng.choice(tenants), "x" * rng.choice([1, 40, 400, 5000]),
                          priority=rng.choice(list(Priority)), max_tokens=rng.choice([1, 16, 600]),
                          timeout_ms=rng.choice([600_000, 600_000, 1_500, 50]),
                          model=rng.choice(["sim-large", "sim-small", "other"]))
        req.created_at = now_ms - rng.choice([0, 0, 0, 100, 60_000])
        req.user_tier = rng.choice(["standard", "standard", "standard", "enterprise", "free", "unknown-tier"])
        req.allow_degrade = rng.random() < 0.5
        req.notify_queued = rng.random() < 0.05
        if rng.random() < 0.05:
            req.trace_id = rng.choice(["trace-1", "bad trace"])
        if rng.random() < 0.03:
            req.max_tokens = 0
        if rng.random() < 0.03:
            req.admitted_at = now_ms  # a client setting the gateway's fields: never trusted
        out.append(req)
    return out


def _run(lane_on: bool, monkeypatch, tmp_path, batches, settings: Settings | None = None) -> tuple:
    monkeypatch.setattr(gateway_app, "Producer", RecordingProducer)
    monkeypatch.setenv("LLMQ_FAST_LANE", "1" if lane_on else "0")
    settings = settings or _settings()
    gateway = Gateway(settings, app_id=f"lane-{tmp_path.name}", web_port=0,
                      datadir=str(tmp_path / f"gw-{lane_on}"))
    assert (gateway._lane is not None) == lane_on
    gateway._depth_loaded = True
    now = [0]
    monkeypatch.setattr(gateway_app, "_now_ms", lambda: now[0])
    monkeypatch.setattr(models, "now_ms", lambda: now[0])  # a response's finished_at
    snapshots = []

    async def run():
        for at_ms, cancelled, records in batches:
            now[0] = at_ms
            gateway.cancellations = Cancellations(cancelled)
            gateway._admit_events(list(records), FakeAcks())
            snapshots.append(_state(gateway))
        gateway._end_period()
        snapshots.append(_state(gateway))

    try:
        asyncio.run(run())
        sent = {}
        for producer in gateway._deliveries.producers:
            for topic, value, key, partition, headers in producer.sent:
                headers = tuple(h for h in headers if h[0] != "llmq.dlq.failed.at")  # the wall clock
                sent.setdefault(topic, []).append((value, key, partition, headers))
        m = gateway.metrics
        metrics = {name: {labels: child.value for labels, child in getattr(m, name).children.items()}
                   for name in ("requests", "rejections", "dead_letters", "degraded", "reprioritised")}
        return snapshots, sent, metrics
    finally:
        gateway._deliveries.close(1)


def _state(gateway) -> dict:
    views = {id(v): (dict(v.values), dict(v.dirty)) for v in gateway._tables.views}
    return {"views": sorted(views.values(), key=repr), "depth": list(gateway.queues.depth),
            "arrivals": (gateway.queues._arrivals._total, [list(c) for c in gateway.queues._arrivals._counts]),
            "seen": dict(gateway._seen), "order": list(gateway._seen_order),
            "period_seen": {p: (id(e[0]), list(e[1])) for p, e in gateway._period_seen.items()},
            "clock": gateway._clock_s}


def _batches(settings: Settings, seed: int, ordinary: float):
    rng = random.Random(seed)
    codec = Codec.default()
    start = 1_800_000_000_000 + rng.randrange(1000)
    batches, offset, every = [], 0, []
    for b in range(12):
        at = start + b * 350  # windows of a second turn over between some batches
        reqs = _requests(rng, at, rng.choice([1, 7, 30]), ordinary)
        records = []
        for req in reqs:
            topic = settings.topics.request_topic(rng.choice([req.priority, Priority.NORMAL]))
            value = codec.encode_request(req, settings.serde.wire_format, topic)
            if rng.random() < 0.03:
                value = value[:-5]  # undecodable: dead-lettered
            if every and rng.random() < 0.08:
                value = rng.choice(every)  # the same id again
            every.append(value)
            records.append(SimpleNamespace(topic=topic, partition=rng.randrange(3), offset=offset, key=b"k",
                                           headers=[], value=value))
            offset += 1
        cancelled = {reqs[0].request_id: "cancelled by the client"} if reqs and rng.random() < 0.5 else {}
        batches.append((at, cancelled, records))
    return batches


@pytest.mark.parametrize("ordinary", [0.0, 0.8])
@pytest.mark.parametrize("seed", range(5))
def test_the_lane_leaves_the_state_and_writes_the_bytes_of_the_python_path(seed, ordinary, monkeypatch, tmp_path):
    batches = _batches(_settings(), seed, ordinary)
    python = _run(False, monkeypatch, tmp_path, batches)
    lane = _run(True, monkeypatch, tmp_path, batches)
    assert lane[0] == python[0]  # tables, queue model, remembered ids, clock: after every batch
    assert lane[1].keys() == python[1].keys()
    for topic in python[1]:
        assert lane[1][topic] == python[1][topic], topic  # each topic's records, in order
    assert lane[2] == python[2]


@pytest.fixture
def lane_gateway(monkeypatch, tmp_path):
    """A gateway with its lane, on llmq's default settings, and its request records' maker."""
    monkeypatch.setattr(gateway_app, "Producer", RecordingProducer)
    monkeypatch.setenv("LLMQ_FAST_LANE", "1")
    settings = Settings.load(env={})
    gateway = Gateway(settings, app_id=f"lane-{tmp_path.name}", web_port=0, datadir=str(tmp_path / "gw"))
    gateway._depth_loaded = True
    codec = Codec.default()
    topic = settings.topics.request_topic(Priority.NORMAL)

    def records(values):
        return [SimpleNamespace(topic=topic, partition=0, offset=i, key=b"acme", headers=[],
                                value=v if not isinstance(v, Request) else
                                codec.encode_request(v, settings.serde.wire_format, topic))
                for i, v in enumerate(values)]

    yield gateway, records
    gateway._deliveries.close(1)


def test_the_lane_admits_ordinary_requests_itself(lane_gateway):
    gateway, records = lane_gateway
    recs = records([Request.new("acme", "hello", priority=Priority.NORMAL) for _ in range(50)])
    stop, values, keys, owners, admitted, failure = gateway._lane.admit(recs, 0, gateway._period_seen, None)
    assert (stop, admitted, failure) == (50, [0, 0, 50, 0, 0], None)
    assert keys[2] == [b"acme"] * 50
    dispatched = Codec.default().decode_request(values[2][0])
    assert dispatched.effective_priority is Priority.NORMAL and dispatched.admitted_at is not None
    assert gateway.queues.depth == [0, 0, 50, 0, 0]
    assert len(gateway._seen) == 50


def test_a_record_the_lane_does_not_read_is_left_to_the_python_path_unchanged(lane_gateway):
    gateway, records = lane_gateway
    recs = records([b"\xc3\x01junk", str(uuid.uuid4())])
    stop, values, keys, owners, admitted, failure = gateway._lane.admit(recs, 0, gateway._period_seen, None)
    assert (stop, admitted, failure) == (0, [0] * 5, None)
    assert gateway._lane.admit(recs, 1, gateway._period_seen, None)[0] == 1  # not bytes: left too
    assert gateway._seen == {} and gateway.queues.depth == [0] * 5


def test_the_cancellation_views_ordered_ids_are_read(lane_gateway):
    from collections import OrderedDict

    gateway, records = lane_gateway
    reqs = [Request.new("acme", "hello", priority=Priority.NORMAL) for _ in range(3)]
    cancelled = OrderedDict({reqs[1].request_id: "changed my mind"})  # CancellationView keeps one
    stop, _, _, _, admitted, failure = gateway._lane.admit(records(reqs), 0, gateway._period_seen, cancelled)
    assert (stop, admitted[2], failure) == (1, 1, None)  # the cancelled one is the Python path's


# -- bytes the Python decoder reads but a writer does not produce ------------------------------

AT = 1_800_000_000_000


def _varint(n: int, pad: int = 0) -> bytes:
    """Avro's zig-zag varint of ``n``, padded with ``pad`` needless bytes (80 .. 00)."""
    u = (n << 1) ^ (n >> 63)
    out = bytearray()
    while u > 0x7F:
        out.append((u & 0x7F) | 0x80)
        u >>= 7
    if pad:
        out.append(u | 0x80)
        out += b"\x80" * (pad - 1) + b"\x00"
    else:
        out.append(u)
    return bytes(out)


def _string(text: str, pad: int = 0) -> bytes:
    data = text.encode()
    return _varint(len(data), pad) + data


def _body(prompt: str = "hello", pads: dict | None = None) -> bytes:
    """An LLMRequest body, field by field (the schema's order), some varints padded."""
    p = pads or {}
    return (_string(str(uuid.uuid4())) + _string("acme") + _varint(2, p.get("priority", 0))
            + _string(prompt, p.get("prompt", 0)) + _string("other") + _varint(16, p.get("max_tokens", 0))
            + _varint(AT) + _varint(600_000) + _string("standard") + _varint(1) + b"\x00" + b"\x00"
            + _varint(0, p.get("trace_id", 0)) + _varint(0, p.get("metadata", 0)) + _varint(0) + _varint(0)
            + _varint(0, p.get("degraded_from", 0)))


def _compare(monkeypatch, tmp_path, bodies, settings: Settings | None = None):
    settings = settings or _settings()
    header = Codec.default()._fast_request_header
    topic = settings.topics.request_topic(Priority.NORMAL)
    records = [SimpleNamespace(topic=topic, partition=0, offset=i, key=b"k", headers=[], value=header + b)
               for i, b in enumerate(bodies)]
    batches = [(AT, {}, records)]
    python = _run(False, monkeypatch, tmp_path, batches, settings)
    lane = _run(True, monkeypatch, tmp_path, batches, settings)
    assert lane == python
    return python


def test_the_written_body_is_the_one_the_lane_reads():
    value = Codec.default()._fast_request_header + _body()
    assert Codec.default().decode_request(value).tenant_id == "acme"


@pytest.mark.parametrize("field", ["priority", "prompt", "max_tokens", "trace_id", "metadata", "degraded_from"])
def test_a_padded_varint_is_left_to_the_python_path_which_writes_it_short(field, monkeypatch, tmp_path):
    python = _compare(monkeypatch, tmp_path, [_body(pads={field: 1}), _body()])
    dispatched = python[1]["llm.dispatch.normal"]
    assert len(dispatched) == 2
    for value, *_ in dispatched:
        assert Codec.default().decode_request(value).effective_priority is Priority.NORMAL


@pytest.mark.parametrize("prompt_chars", [3_000, 4_093, 4_094, 4_096, 4_200])
def test_records_at_the_record_size_bound_go_where_the_python_path_sends_them(prompt_chars, monkeypatch, tmp_path):
    settings = _settings()
    settings.serde.max_record_bytes = 8192  # "é" is two bytes: bodies and dispatches around the bound
    _compare(monkeypatch, tmp_path, [_body("\u00e9" * prompt_chars)], settings)


def test_a_counter_that_is_not_an_int_leaves_the_request_to_the_python_path(lane_gateway):
    gateway, records = lane_gateway
    gateway._admitted.values["NORMAL\x1fp0"] = 1.5  # the band's depth on partition 0, oddly kept

    async def run():
        gateway._admit_events(records([Request.new("acme", "hello", priority=Priority.NORMAL)]), FakeAcks())

    asyncio.run(run())
    assert gateway._lane is not None  # nothing failed: the lane left the request before changing anything
    assert sum(1 for t, *_ in gateway.out.sent if t.endswith(".dispatch.normal")) == 1
    assert gateway.queues.depth == [0, 0, 1, 0, 0] and gateway._admitted.values["NORMAL\x1fp0"] == 2.5


def test_a_dispatch_the_producer_refuses_is_dead_lettered_and_the_batch_goes_on(lane_gateway):
    from confluent_kafka import KafkaError, KafkaException

    gateway, records = lane_gateway
    sent, produce = [], gateway.out.produce

    def refuse_the_third(topic, value, key=None, headers=None, on_delivery=None, partition=None):
        if ".dispatch." in topic:
            if value not in sent:
                sent.append(value)
            if len(sent) >= 3 and value == sent[2]:  # the third one, every time it is tried
                raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        produce(topic, value, key, headers, on_delivery, partition)

    gateway.out.produce = refuse_the_third
    gateway.bulk_out.produce = refuse_the_third

    async def run():
        gateway._admit_events(records([Request.new("acme", "hello", priority=Priority.NORMAL) for _ in range(4)]),
                              FakeAcks())
        period = gateway._period
        assert period.produced == period.delivered  # the refused one is not waited for

    asyncio.run(run())
    topics = [t for t, *_ in gateway.out.sent]
    assert topics.count("llm.dispatch.normal") == 3 and topics.count("llm.dlq") == 1
    assert gateway._lane is not None
