"""Property tests of the worker's admission path (``Worker.handle``), without a broker.

Whatever the bytes of a request message, the worker must publish exactly one outcome for
it -- a response on the responses topic or a dead letter (with the original bytes) on the
DLQ topic -- never raise, and let the partition's committable position move past it.

The worker is a real :class:`Worker` with a fake producer (it acknowledges every message
at once) and fake consumer messages; the backend is the zero-latency simulation, which
answers synchronously, so no event loop is needed.
"""

from __future__ import annotations

import uuid

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from pipeline.config import Settings
from pipeline.errors import DecodeError, LimitExceeded
from pipeline.models import Priority, Request, Status, TaskTier, now_ms
from pipeline.policy.validation import validate_request
from pipeline.serde import Codec, SchemaStore, SerdeLimits
from pipeline.testing import FakeMessage, avro_string, zigzag
from pipeline.worker.backends.simulated import SimulatedBackend
from pipeline.worker.loop import Worker

# Small enough limits that hypothesis reaches them; the responses to requests within them
# always fit in max_record_bytes (see test_a_response_larger_than_max_record_bytes...).
LIMITS = dict(max_record_bytes=16_384, max_prompt_bytes=4_096, max_metadata_entries=8, max_string_bytes=1_024)
DLQ_REASONS = {"too_large", "truncated", "bad_magic", "unknown_fingerprint", "unknown_schema_id", "malformed",
               "limit_exceeded", "invalid_field", "empty"}
REASON_PREFIXES = {Status.REJECTED: ("invalid_request: ", "duplicate_request_id: "),
                   Status.EXPIRED: ("deadline_passed: ",),
                   Status.FAILED: ("response_too_large: ", "backend_error: ")}

_STORE = SchemaStore.load()
_REV = {r.revision: r for r in _STORE.revisions("llm_request")}
HEADERS = {3: b"\xc3\x01" + _REV[3].fingerprint.le_bytes,
           2: b"\xc3\x01" + _REV[2].fingerprint.le_bytes,
           1: b"\xc3\x01" + _REV[1].fingerprint.le_bytes}
FIELDS = {3: ("request_id", "tenant_id", "priority", "prompt", "model", "max_tokens", "created_at", "timeout_ms",
              "user_tier", "task_tier", "allow_degrade", "notify_queued", "trace_id", "metadata",
              "admitted_at", "effective_priority", "degraded_from")}
FIELDS[2] = FIELDS[3][:-3]
FIELDS[1] = tuple(f for f in FIELDS[2] if f not in ("notify_queued", "trace_id"))
KINDS = {"request_id": "string", "tenant_id": "string", "priority": "enum", "prompt": "string", "model": "string",
         "max_tokens": "long", "created_at": "long", "timeout_ms": "long", "user_tier": "string",
         "task_tier": "enum", "allow_degrade": "boolean", "notify_queued": "boolean", "trace_id": "union",
         "metadata": "map", "admitted_at": "optional_long", "effective_priority": "optional_enum",
         "degraded_from": "union"}


def test_field_lists_match_the_published_revisions():
    for revision, fields in FIELDS.items():
        assert tuple(f["name"] for f in _REV[revision].parsed["fields"]) == fields
    # Revision 4 appends fields with defaults: what revision 3 writers send still decodes.
    current = _STORE.current_revision("llm_request")
    assert current.revision == 4 and tuple(f["name"] for f in current.parsed["fields"])[:len(FIELDS[3])] == FIELDS[3]


# -- a raw Avro writer that writes whatever it is given -------------------------------------------


zz, _string = zigzag, avro_string


def _field(kind: str, value) -> bytes:
    if kind == "string":
        return _string(value)
    if kind in ("long", "enum"):
        return zz(value)
    if kind == "boolean":
        return bytes((value,))
    if kind == "union":
        return b"\x00" if value is None else b"\x02" + _string(value)
    if kind in ("optional_long", "optional_enum"):
        return b"\x00" if value is None else b"\x02" + zz(value)
    if not value:
        return b"\x00"
    return zz(len(value)) + b"".join(_string(k) + _string(v) for k, v in value) + b"\x00"


def raw_message(revision: int, values: dict) -> bytes:
    return HEADERS[revision] + b"".join(_field(KINDS[name], values[name]) for name in FIELDS[revision])


# -- the worker under test ---------------------------------------------------------------------------


class FakeProducer:
    """Acknowledges every message at once; keeps what it was given."""

    def __init__(self):
        self.sent: list[FakeMessage] = []

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None, partition=-1, **_):
        msg = FakeMessage(topic, max(partition, 0), len(self.sent), value, key, headers)
        self.sent.append(msg)
        if on_delivery is not None:
            on_delivery(None, msg)

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=0):
        return 0


def make_worker(backend=None, **limits) -> Worker:
    s = Settings.load(env={})
    for name, value in {**LIMITS, **limits}.items():
        setattr(s.serde, name, value)
    worker = Worker(s, backend or SimulatedBackend(), worker_id="fuzz-worker")
    worker.session.producer = FakeProducer()
    return worker


class Harness:
    def __init__(self, worker: Worker):
        self.worker = worker
        self.topic = worker.settings.topics.request_topic(Priority.NORMAL)
        self.tp = (self.topic, 0)
        self.offset = 0
        # An independent codec with the same limits, for the expected decode outcome.
        self.reference = Codec(SchemaStore.load(), worker.settings.serde.limits())
        self.first: dict[str, tuple[str, bytes]] = {}  # request id → (tenant, its first answer)

    def handle(self, value: bytes | None, key: bytes | None = b"key", headers=None):
        """Run one message through ``_handle``; check the one outcome and the offset; return it."""
        worker, producer = self.worker, self.worker.producer
        offset = self.offset
        self.offset += 1
        before = len(producer.sent)
        worker.handle(FakeMessage(self.topic, 0, offset, value, key, headers))  # must not raise
        out = producer.sent[before:]
        assert len(out) == 1, f"{len(out)} outcomes for one message"
        out = out[0]
        # The committable position is past this message, and nothing is left in flight.
        assert worker.checkpoint.tracker.to_commit() == [(self.tp, offset + 1)]
        worker.checkpoint.tracker.mark_committed([(self.tp, offset + 1)])
        assert worker.checkpoint.tracker.in_flight(self.tp) == 0
        assert not worker.running

        expected_reason = refusal = None
        if not value:  # tombstone or zero bytes: one reason for both
            expected_reason = "empty"
        else:
            try:
                request = self.reference.decode_request(value)
            except LimitExceeded as exc:  # over a size cap, answered if it says who sent it
                if exc.request is None:
                    expected_reason = exc.reason
                else:
                    request, refusal = exc.request, exc.refusal
            except DecodeError as exc:
                expected_reason = exc.reason
        if out.topic() == worker.dlq_topic:
            # llmq's own headers come first; the producer's (maybe spoofed) ones follow.
            reason = next(v for k, v in out.headers() if k == "llmq.dlq.reason").decode()
            assert reason == expected_reason
            assert reason in DLQ_REASONS
            assert out.value() == value and out.key() == key
            return ("dlq", reason)
        assert out.topic() == worker.responses_topic, out.topic()
        assert expected_reason is None, f"decodable by the worker but not by the codec ({expected_reason})"
        resp = worker.codec.decode_response(out.value())
        if refusal is not None:
            assert resp.status is Status.REJECTED and resp.reason == refusal
            assert resp.request_id == request.request_id and resp.tenant_id == request.tenant_id
            return ("response", "over_limit")
        first = self.first.get(request.request_id)
        if first is not None and validate_request(request, now_ms()) is None:
            # A valid copy of an id answered before: the same answer again, for the same tenant only.
            if request.tenant_id == first[0]:
                assert out.value() == first[1]
                return ("response", "repeated")
            assert resp.status is Status.REJECTED and resp.reason.startswith("duplicate_request_id: ")
        assert resp.request_id == request.request_id and resp.tenant_id == request.tenant_id
        assert resp.requested_priority is request.priority
        # Every outcome carries the gateway's decisions, whichever the status.
        assert resp.served_priority is (request.effective_priority or request.priority)
        assert resp.admitted_at == request.admitted_at
        assert resp.degraded is (request.degraded_from is not None)
        if resp.status is Status.COMPLETED:
            assert resp.reason is None
        else:
            assert resp.status in REASON_PREFIXES, resp.status
            assert resp.reason.startswith(REASON_PREFIXES[resp.status]), resp.reason
        if first is None and resp.status is not Status.REJECTED:
            self.first[request.request_id] = (request.tenant_id, out.value())
        return ("response", resp.status.value)


_HARNESS: Harness | None = None


def harness() -> Harness:
    """One worker for the whole module (building its codec compiles code)."""
    global _HARNESS
    if _HARNESS is None:
        _HARNESS = Harness(make_worker())
    return _HARNESS


def fuzz(n: int):
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NOW = now_ms()  # fixed: strategies must not depend on the clock

# -- strategies ------------------------------------------------------------------------------------

int32 = st.integers(-(2**31), 2**31 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)
# Hostile text: control characters, format characters, long runs, some multi-byte.
hostile_chars = st.sampled_from(["\x00", "\n", "\r", "\x1b", "\x7f", "\x85", "\u202e", "\u2028", "\ufeff", " ", "é",
                                 "\U0001f600", "a", "-", "0"])
hostile_text = st.one_of(
    st.text(max_size=40),
    st.lists(hostile_chars, max_size=40).map("".join),
    st.builds(lambda c, n: c * n, hostile_chars, st.integers(0, 1500)),
)
hostile_string = st.one_of(hostile_text, st.binary(max_size=40))  # bytes: maybe invalid UTF-8
request_ids = st.one_of(st.uuids().map(str), st.uuids().map(lambda u: str(u).upper()), hostile_string)


@st.composite
def hostile_requests(draw) -> bytes:
    revision = draw(st.sampled_from([1, 2, 3]))
    valid = draw(st.booleans())  # half of them start from valid values, with few changes

    def pick(strategy, ordinary):
        return draw(strategy) if not valid or draw(st.integers(0, 5)) == 0 else ordinary

    values = {
        "request_id": pick(request_ids, str(uuid.uuid4())),
        "tenant_id": pick(hostile_string, "tenant-fuzz"),
        "priority": pick(st.integers(-3, 8), 2),
        "prompt": pick(st.one_of(hostile_string, st.builds(lambda n: "p" * n, st.integers(0, 5000))), "hello"),
        "model": pick(hostile_string, "sim-small"),
        "max_tokens": pick(st.one_of(int32, int64, st.integers(-2, 2), st.just(1_000_001)), 16),
        "created_at": pick(st.one_of(int64, st.integers(NOW - 10**9, NOW + 10**9)), NOW),
        "timeout_ms": pick(st.one_of(int64, st.integers(-2, 120_000)), 600_000),
        "user_tier": pick(hostile_string, "standard"),
        "task_tier": pick(st.integers(-2, 4), 1),
        "allow_degrade": pick(st.integers(0, 3), 0),
        "notify_queued": pick(st.integers(0, 3), 0),
        "trace_id": pick(st.none() | hostile_string, None),
        "metadata": pick(st.lists(st.tuples(hostile_string, hostile_string), max_size=12), []),
        "admitted_at": pick(st.none() | int64, None),
        "effective_priority": pick(st.none() | st.integers(-3, 8), None),
        "degraded_from": pick(st.none() | hostile_string, None),
    }
    return raw_message(revision, values)


valid_requests = st.builds(
    Request,
    request_id=st.uuids().map(str),
    tenant_id=st.text(min_size=1, max_size=20),
    priority=st.sampled_from(Priority),
    prompt=st.text(min_size=1, max_size=200),
    model=st.text(min_size=1, max_size=20),
    max_tokens=st.integers(1, 4096),
    created_at=st.integers(NOW - 10**6, NOW + 10**6),
    timeout_ms=st.integers(1, 10**7),
    user_tier=st.text(max_size=10),
    task_tier=st.sampled_from(TaskTier),
    allow_degrade=st.booleans(),
    notify_queued=st.booleans(),
    trace_id=st.none() | st.text(max_size=20),
    metadata=st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=LIMITS["max_metadata_entries"]),
    admitted_at=st.none() | st.integers(NOW - 10**6, NOW + 10**6),
    effective_priority=st.none() | st.sampled_from(Priority),
    degraded_from=st.none() | st.text(min_size=1, max_size=20),
)


def _v1_message(req: Request) -> bytes:
    rec = req.to_record()
    rec["priority"] = list(Priority).index(req.priority)
    rec["task_tier"] = list(TaskTier).index(req.task_tier)
    rec["allow_degrade"] = int(req.allow_degrade)
    rec["metadata"] = list(req.metadata.items())
    return raw_message(1, rec)


@st.composite
def encoded_requests(draw) -> bytes:
    req = draw(valid_requests)
    if draw(st.booleans()):
        return _v1_message(req)
    return Codec.default().encode_request(req)


def mutate(data: bytes, ops) -> bytes:
    """Apply ``ops``: ``where`` in [0, 1) is a place in the body, in [-0.25, 0) one in the header."""
    buf = bytearray(data)
    for op, where, payload in ops:
        if where < 0:
            i = int(-where * 4 * min(10, len(buf)))
        else:
            i = min(10, len(buf)) + int(where * max(0, len(buf) - 10))
        if op == "flip" and buf:
            buf[min(i, len(buf) - 1)] ^= 1 << (payload[0] % 8 if payload else 0)
        elif op == "set" and buf:
            buf[min(i, len(buf) - 1)] = payload[0] if payload else 0xFF
        elif op == "truncate":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = payload
        elif op == "delete":
            del buf[i:i + 1 + len(payload)]
        elif op == "duplicate":
            buf[i:i] = buf[i:i + 1 + len(payload)]
    return bytes(buf)


mutations = st.lists(st.tuples(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "duplicate"]),
                               st.floats(-0.25, 1, exclude_max=True), st.binary(max_size=12)), min_size=1, max_size=4)


# -- properties ------------------------------------------------------------------------------------


@fuzz(1500)
@given(st.one_of(
    st.binary(max_size=600),
    st.builds(lambda h, b: h + b, st.sampled_from(list(HEADERS.values()) + [b"\x00\x00\x00\x00\x01", b"\xc3\x01"]),
              st.binary(max_size=600)),
))
@example(b"")
@example(HEADERS[3])
@example(HEADERS[3] + b"\x00" * 13 + zz(1 << 62))
@example(HEADERS[2] + b"\x00" * 13 + zz(1 << 62))
@example(HEADERS[1] + b"\x00" * 11 + zz(1 << 62))
@example(b"\xff" * (LIMITS["max_record_bytes"] + 1))
def test_arbitrary_bytes_get_exactly_one_outcome(data):
    event(":".join(harness().handle(data)))


@fuzz(800)
@given(encoded_requests(), mutations)
def test_mutated_valid_requests_get_exactly_one_outcome(data, ops):
    event(":".join(harness().handle(mutate(data, ops))))


@fuzz(800)
@given(hostile_requests(), st.one_of(st.none(), st.binary(max_size=64)),
       st.none() | st.lists(st.tuples(st.sampled_from(["tenant_id", "priority", "llmq.dlq.reason", "x"]),
                                      st.none() | st.binary(max_size=16)), max_size=4))
def test_hostile_field_values_get_exactly_one_outcome(data, key, headers):
    event(":".join(harness().handle(data, key=key, headers=headers)))


@settings(max_examples=200, deadline=None)
@given(valid_requests)
def test_valid_requests_are_answered_by_their_body(req):
    kind = harness().handle(Codec.default().encode_request(req))
    assert kind[0] == "response"


def test_tombstones_and_duplicates():
    h = harness()
    assert h.handle(None) == ("dlq", "empty")
    req = Request.new("tenant-dup", "twice")
    data = Codec.default().encode_request(req)
    assert h.handle(data) == ("response", "COMPLETED")
    first = h.worker.producer.sent[-1].value()
    assert h.handle(data) == ("response", "repeated")  # the copy: the first answer again
    assert h.worker.producer.sent[-1].value() == first


def test_a_revision_1_message_is_completed():
    req = Request.new("tenant-v1", "old writer", priority=Priority.HIGH)
    assert harness().handle(_v1_message(req)) == ("response", "COMPLETED")


def test_a_response_larger_than_max_record_bytes_is_answered_failed_not_crashing_the_worker():
    from pipeline.worker.backends.base import Completion

    class RunawayModel(SimulatedBackend):
        def complete_now(self, request):
            return Completion("x" * 20_000, 1, 5_000, request.model)  # over max_record_bytes

    worker = make_worker(RunawayModel())
    h = Harness(worker)
    assert h.handle(h.reference.encode_request(Request.new("t", "tell me everything"))) == ("response", "FAILED")
    response = h.reference.decode_response(worker.producer.sent[-1].value())
    assert response.reason.startswith("response_too_large")
    assert response.output is None


def test_a_request_over_a_size_cap_is_answered_rejected_naming_the_limit_not_dead_lettered():
    h = harness()
    big = Codec(SchemaStore.load(), SerdeLimits(max_prompt_bytes=10**6))
    req = Request.new("tenant-big", "p" * (LIMITS["max_prompt_bytes"] + 1), reply_partition=1)
    assert h.handle(big.encode_request(req)) == ("response", "over_limit")
    out = h.worker.producer.sent[-1]
    assert out.partition() == 1  # where any answer of it goes
    resp = h.reference.decode_response(out.value())
    assert resp.reason == (f"invalid_request: prompt is {LIMITS['max_prompt_bytes'] + 1} bytes, over the "
                           f"{LIMITS['max_prompt_bytes']}-byte limit (max_prompt_bytes)")
    # Its tenant over the cap: nobody to answer.
    assert h.handle(big.encode_request(Request.new("t" * 1025, "p" * 5000))) == ("dlq", "limit_exceeded")
