"""The generated fast path against fastavro: same bytes out, same records (or errors) in.

``FAST`` is a codec using the code :mod:`pipeline.serde.fastpath` generates for the
current schemas; ``SLOW`` is the same codec forced onto fastavro (``fast=False``).

Encoding must be byte-for-byte identical, and whatever the fast path does not handle
itself must give exactly fastavro's result (the same ``EncodeError`` message).

Decoding must agree on every input: the same object when fastavro's path returns one,
and a :class:`DecodeError` whenever fastavro's path raises one, with the same reason.
The deliberate differences, which :func:`_check_agreement` allows and nothing else:

* **stricter** — the fast path raises where fastavro's path returns a record:

  - a boolean byte other than ``00``/``01`` (``invalid_field``; fastavro: ``true``),
  - a negative enum or union index (``invalid_field``; fastavro indexes from the end),
  - an ``int`` (value, enum or union index) encoded in more than 5 bytes
    (``invalid_field``),
  - a varint longer than 10 bytes or beyond 64 bits (``malformed``; fastavro wraps);

  each of these can also come first in a message fastavro rejects for a later
  defect, so the reasons then differ;
* **the map entry cap** is enforced at the block count, before the map is read:
  ``limit_exceeded`` (or ``truncated`` when the rest of the message cannot hold that
  many entries) even where fastavro's path first hits another defect later on, and
  counting duplicate keys;
* **fastavro's path misnames** an out-of-range enum/union index in the very last byte
  as ``truncated`` ("ends inside a number"); the fast path says ``invalid_field``.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import random
import re

import fastavro
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.errors import DecodeError, EncodeError
from pipeline.models import Priority, Request, Response, Status, TaskTier
from pipeline.serde import Codec, RegistryFormat, SchemaStore, SerdeLimits, fastpath
from pipeline.serde.fastpath import (
    REQUEST_BINDING,
    RESPONSE_BINDING,
    FieldCaps,
    UnsupportedSchema,
    compile_codec,
)
from tests.unit.serde import (
    SCHEMAS_DIR,
    avro_body,
    full_request,
    full_response,
    history_schema,
    load_json,
    minimal_request,
    minimal_response,
    pinned_schema_dir,
    write_schema_dir,
    zigzag,
)

STORE = SchemaStore.load(SCHEMAS_DIR)
REGISTRY = RegistryFormat.from_url("mock://fastpath")
FAST = Codec(STORE, registry=REGISTRY)
SLOW = Codec(STORE, registry=REGISTRY, fast=False)
TOPIC = "fastpath"
REQUEST_SCHEMA = load_json(SCHEMAS_DIR / "llm_request.avsc")
RESPONSE_SCHEMA = load_json(SCHEMAS_DIR / "llm_response.avsc")

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ---------------------------------------------------------------------------

_INT32_EDGES = [0, 1, -1, 63, 64, -64, -65, 8191, 8192, -8192, -8193, 2**31 - 1, -(2**31)]
_INT64_EDGES = _INT32_EDGES + [
    2**27 - 1, 2**27, 2**41 - 1, 2**41, -(2**27), 2**31, -(2**31) - 1, 2**35, 2**42, 2**49, 2**56, 2**62,
    2**63 - 1, -(2**63), 1_700_000_000_123, -1_700_000_000_123,
]
int32 = st.sampled_from(_INT32_EDGES) | st.integers(-(2**31), 2**31 - 1)
int64 = st.sampled_from(_INT64_EDGES) | st.integers(-(2**63), 2**63 - 1)
# Empty strings, ASCII, multi-byte characters, and lengths around the 1/2-byte varint limit.
text = st.text(max_size=40) | st.sampled_from(["", "é", "✓", "🚀", "x" * 63, "x" * 64, "€" * 22])
long_text = st.text(max_size=300) | st.sampled_from(["", "a" * 8191, "b" * 8192, "ü" * 4100])
metadata = st.dictionaries(text, text, max_size=6)

requests = st.builds(
    Request,
    request_id=st.uuids().map(str) | text,
    tenant_id=text,
    priority=st.sampled_from(Priority),
    prompt=long_text,
    model=text,
    max_tokens=int32,
    created_at=int64,
    timeout_ms=int64,
    user_tier=text,
    task_tier=st.sampled_from(TaskTier),
    allow_degrade=st.booleans(),
    notify_queued=st.booleans(),
    trace_id=st.none() | text,
    metadata=metadata,
    admitted_at=st.none() | int64,
    effective_priority=st.none() | st.sampled_from(Priority),
    degraded_from=st.none() | text,
)

responses = st.builds(
    Response,
    request_id=st.uuids().map(str) | text,
    tenant_id=text,
    status=st.sampled_from(Status),
    reason=st.none() | text,
    output=st.none() | long_text,
    prompt_tokens=int32,
    completion_tokens=int32,
    model=st.none() | text,
    degraded=st.booleans(),
    requested_priority=st.sampled_from(Priority),
    served_priority=st.none() | st.sampled_from(Priority),
    created_at=int64,
    admitted_at=st.none() | int64,
    started_at=st.none() | int64,
    finished_at=int64,
    worker_id=st.none() | text,
    retry_after_ms=st.none() | int64,
    metadata=metadata,
    queue_position=st.none() | int64,
    eta_ms=st.none() | int64,
)

wires = st.sampled_from(["single-object", "confluent"])


# -- the agreement check -------------------------------------------------------------------

_STRICT = re.compile(
    r"boolean byte 0x[0-9a-f]{2} is neither"
    r"|negative (enum|union) index"
    r"|int encoded in \d+ bytes"
    r"|varint at offset \d+ (is longer than 10 bytes|exceeds 64 bits)"
)
_STRICT_REASONS = {"boolean byte": "invalid_field", "negative enum": "invalid_field", "negative union": "invalid_field",
                   "int encoded": "invalid_field", "varint": "malformed"}


def _outcome(decode, data: bytes):
    try:
        return decode(data), None
    except DecodeError as exc:
        return None, exc


def _is_strict(exc: DecodeError) -> bool:
    match = _STRICT.search(exc.detail)
    if match is None:
        return False
    expected = next(reason for key, reason in _STRICT_REASONS.items() if match.group(0).startswith(key))
    assert exc.reason == expected, exc
    return True


def _check_agreement(kind: str, data: bytes) -> str:
    """Decode ``data`` both ways and check they agree (see the module docstring).

    Returns ``"same"``, ``"stricter"`` or ``"different reason"`` for statistics.
    """
    fast_obj, fast_exc = _outcome(getattr(FAST, f"decode_{kind}"), data)
    slow_obj, slow_exc = _outcome(getattr(SLOW, f"decode_{kind}"), data)
    if fast_exc is None:
        assert slow_exc is None, f"the fast path accepted what fastavro refuses: {slow_exc} ({data.hex()})"
        assert fast_obj == slow_obj
        return "same"
    if slow_exc is None:
        assert _is_strict(fast_exc), f"the fast path refused what fastavro accepts: {fast_exc} ({data.hex()})"
        return "stricter"
    assert type(fast_exc) is type(slow_exc)
    if fast_exc.reason == slow_exc.reason:
        if fast_exc.reason == "limit_exceeded" and "entries exceed" not in fast_exc.detail:
            assert fast_exc.detail == slow_exc.detail  # the same check names the same field
        return "same"
    allowed = (
        _is_strict(fast_exc)
        or (fast_exc.reason == "limit_exceeded" and "entries exceed" in fast_exc.detail)
        or (fast_exc.reason == "truncated" and "entries cannot fit" in fast_exc.detail)
        or (
            slow_exc.reason == "truncated"
            and "inside a number" in slow_exc.detail
            and fast_exc.reason == "invalid_field"
            and "index" in fast_exc.detail
        )
    )
    assert allowed, f"fast: {fast_exc!r}, fastavro: {slow_exc!r} ({data.hex()})"
    return "different reason"


# -- the codec uses it ------------------------------------------------------------------------


def test_default_codec_uses_the_fast_path():
    assert Codec.default().fast
    assert FAST.fast and not SLOW.fast


def test_generated_source_is_kept():
    assert "def decode(data, pos):" in FAST._fast_request.decode_source
    assert "def encode(obj, header):" in FAST._fast_response.encode_source


# -- encoding -------------------------------------------------------------------------------


def _fast_encode(codec: Codec, obj) -> bytes:
    """The generated encoder itself (asserting it did not hand the record to fastavro)."""
    if isinstance(obj, Request):
        fast, header = codec._fast_request, codec._request_header
    else:
        fast, header = codec._fast_response, codec._response_header
    data = fast.encode(obj, header)
    assert data is not None, "the fast path bailed out on a valid record"
    return data


@PROPERTY
@given(requests)
@example(full_request())
@example(minimal_request())
@example(minimal_request(request_id="", tenant_id="", prompt="", model="", user_tier=""))
@example(full_request(max_tokens=2**31 - 1, created_at=-(2**63), timeout_ms=2**63 - 1))
def test_request_bytes_equal_fastavro(req):
    data = _fast_encode(FAST, req)
    assert data == SLOW.encode_request(req)
    assert data[10:] == avro_body(REQUEST_SCHEMA, req.to_record())
    assert FAST.encode_request(req) == data


@PROPERTY
@given(responses)
@example(full_response())
@example(minimal_response())
@example(full_response(prompt_tokens=-(2**31), retry_after_ms=2**63 - 1, output=""))
def test_response_bytes_equal_fastavro(resp):
    data = _fast_encode(FAST, resp)
    assert data == SLOW.encode_response(resp)
    assert data[10:] == avro_body(RESPONSE_SCHEMA, resp.to_record())


@settings(max_examples=50, deadline=None)
@given(requests, responses)
def test_confluent_bytes_equal_fastavro(req, resp):
    assert FAST.encode_request(req, wire="confluent", topic=TOPIC) == SLOW.encode_request(
        req, wire="confluent", topic=TOPIC
    )
    assert FAST.encode_response(resp, wire="confluent", topic=TOPIC) == SLOW.encode_response(
        resp, wire="confluent", topic=TOPIC
    )


def _encode_error(codec: Codec, obj) -> str:
    encode = codec.encode_request if isinstance(obj, Request) else codec.encode_response
    with pytest.raises(EncodeError) as info:
        encode(obj)
    return str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [
        {"prompt": 42},
        {"tenant_id": None},
        {"metadata": {"k": 1}},
        {"metadata": {1: "v"}},
        {"metadata": [("k", "v")]},
        {"max_tokens": "many"},
        {"max_tokens": 2**31},
        {"max_tokens": -(2**31) - 1},
        {"max_tokens": 1.5},
        {"max_tokens": True},
        {"created_at": 2**63},
        {"created_at": -(2**63) - 1},
        {"timeout_ms": None},
        {"trace_id": 7},
        {"prompt": "lone surrogate \ud800"},
        {"metadata": {"k": "\udfff"}},
        {"priority": "HIGH"},
    ],
)
def test_request_encode_errors_are_fastavros(overrides):
    req = full_request(**overrides)
    assert FAST._fast_request.encode(req, FAST._request_header) is None
    assert _encode_error(FAST, req) == _encode_error(SLOW, req)


@pytest.mark.parametrize(
    "overrides",
    [
        {"started_at": 1.5},
        {"served_priority": "LOW"},
        {"status": None},
        {"output": b"bytes"},
        {"completion_tokens": 2**40},
        {"retry_after_ms": "soon"},
    ],
)
def test_response_encode_errors_are_fastavros(overrides):
    resp = full_response(**overrides)
    assert FAST._fast_response.encode(resp, FAST._response_header) is None
    assert _encode_error(FAST, resp) == _encode_error(SLOW, resp)


@pytest.mark.parametrize(
    "overrides",
    [
        {"allow_degrade": 1},  # fastavro writes any truthy value as true
        {"notify_queued": ""},
        {"metadata": type("D", (dict,), {})({"k": "v"})},  # a dict subclass
        {"priority": TaskTier.BACKGROUND},  # another enum's member with a Priority symbol
    ],
)
def test_what_the_fast_path_leaves_to_fastavro_still_encodes_the_same(overrides):
    req = full_request(**overrides)
    assert FAST._fast_request.encode(req, FAST._request_header) is None
    assert FAST.encode_request(req) == SLOW.encode_request(req)


def test_model_subclasses_encode_through_to_record():
    class Tagged(Request):
        __slots__ = ()

        def to_record(self):
            return {**super().to_record(), "user_tier": "tagged"}

    req = Tagged(**{f: getattr(full_request(), f) for f in Request.__dataclass_fields__})
    assert FAST.decode_request(FAST.encode_request(req)).user_tier == "tagged"
    assert FAST.encode_request(req) == SLOW.encode_request(req)


def test_encode_caps_are_fastavros():
    limits = SerdeLimits(max_prompt_bytes=100, max_string_bytes=40, max_metadata_entries=3, max_record_bytes=150)
    fast, slow = Codec(STORE, limits), Codec(STORE, limits, fast=False)
    for req in (
        full_request(prompt="x" * 101),
        full_request(prompt="€" * 34),
        full_request(tenant_id="t" * 41),
        full_request(user_tier="é" * 21),
        full_request(trace_id="r" * 41),
        full_request(metadata={"a": "1", "b": "2", "c": "3", "d": "4"}),
        full_request(metadata={"k" * 41: "v"}),
        full_request(metadata={"k": "v" * 41}),
        minimal_request(prompt="p" * 100),  # within the caps, but over max_record_bytes
    ):
        assert fast._fast_request.encode(req, fast._request_header) is None
        assert _encode_error(fast, req) == _encode_error(slow, req)
    # exactly at the caps (and a record size limit they fit in)
    limits = SerdeLimits(max_prompt_bytes=100, max_string_bytes=40, max_metadata_entries=3)
    fast, slow = Codec(STORE, limits), Codec(STORE, limits, fast=False)
    ok = full_request(prompt="€" * 33, tenant_id="t" * 40, metadata={"k": "é" * 20, "a": "", "b": ""})
    assert _fast_encode(fast, ok) == slow.encode_request(ok)


# -- decoding -------------------------------------------------------------------------------


@PROPERTY
@given(requests, wires)
@example(full_request(), "single-object")
@example(minimal_request(), "single-object")
def test_request_decodes_like_fastavro(req, wire):
    data = SLOW.encode_request(req, wire=wire, topic=TOPIC)
    decoded = FAST.decode_request(data)
    assert decoded == SLOW.decode_request(data) == req
    assert type(decoded.priority) is Priority and type(decoded.task_tier) is TaskTier
    assert type(decoded.allow_degrade) is bool and type(decoded.metadata) is dict


@PROPERTY
@given(responses, wires)
@example(full_response(), "single-object")
@example(minimal_response(), "single-object")
def test_response_decodes_like_fastavro(resp, wire):
    data = SLOW.encode_response(resp, wire=wire, topic=TOPIC)
    decoded = FAST.decode_response(data)
    assert decoded == SLOW.decode_response(data) == resp
    assert type(decoded.status) is Status
    assert decoded.served_priority is None or type(decoded.served_priority) is Priority


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests, wires)
@example(full_request(), "single-object")
@example(full_request(prompt="p" * 200), "confluent")
def test_every_request_prefix_agrees(req, wire):
    data = SLOW.encode_request(req, wire=wire, topic=TOPIC)
    for cut in range(len(data)):
        _check_agreement("request", data[:cut])
        with pytest.raises(DecodeError) as info:
            FAST.decode_request(data[:cut])
        assert info.value.reason == "truncated", cut


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses)
@example(full_response())
def test_every_response_prefix_agrees(resp):
    data = SLOW.encode_response(resp)
    for cut in range(len(data)):
        with pytest.raises(DecodeError) as info:
            FAST.decode_response(data[:cut])
        assert info.value.reason == "truncated", cut
        _check_agreement("response", data[:cut])


_SPECIAL_BYTES = st.sampled_from([0x00, 0x01, 0x02, 0x03, 0x7E, 0x7F, 0x80, 0x81, 0xFE, 0xFF])


@st.composite
def mutations(draw, messages):
    """A valid message with a few bytes replaced, inserted or deleted."""
    data = bytearray(draw(messages))
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(10, len(data) - 1))  # keep the header: exercise the body
        byte = draw(_SPECIAL_BYTES | st.integers(0, 255))
        action = draw(st.sampled_from(["replace", "replace", "insert", "delete"]))
        if action == "replace":
            data[position] = byte
        elif action == "insert":
            data.insert(position, byte)
        elif len(data) > 11:
            del data[position]
    return bytes(data)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations(requests.map(SLOW.encode_request)))
def test_mutated_requests_agree(data):
    _check_agreement("request", data)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations(responses.map(SLOW.encode_response)))
def test_mutated_responses_agree(data):
    _check_agreement("response", data)


_REQUEST_HEADER = FAST.encode_request(full_request())[:10]
_RESPONSE_HEADER = FAST.encode_response(full_response())[:10]


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bodies_agree(body):
    _check_agreement("request", _REQUEST_HEADER + body)
    _check_agreement("response", _RESPONSE_HEADER + body)


def test_many_random_mutations_agree():
    """Plain random byte changes, many of them (cheaper than hypothesis examples).

    Also a sanity check of the allowed differences: they stay the exception.
    """
    rng = random.Random(1234)
    seeds = {
        "request": [full_request(), minimal_request(), full_request(metadata={}, trace_id=None, prompt="x" * 300)],
        "response": [full_response(), minimal_response(), full_response(output="o" * 200, metadata={})],
    }
    counts = {"same": 0, "stricter": 0, "different reason": 0}
    for kind, objs in seeds.items():
        encode = getattr(FAST, f"encode_{kind}")
        for i in range(4000):
            data = bytearray(encode(objs[i % len(objs)]))
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(10, len(data))] = rng.choice([0, 1, 2, 0x7F, 0x80, 0xFF, rng.randrange(256)])
            counts[_check_agreement(kind, bytes(data))] += 1
    assert counts["same"] > 0.9 * sum(counts.values()), counts


# -- the deliberate differences, one by one ------------------------------------------------------


def _minimal_request_bytes() -> bytes:
    # header, request_id(len 0), tenant(0), priority NORMAL (04), prompt(0), model(0),
    # max_tokens 0, created_at 0, timeout_ms 0, user_tier(0), task_tier ASYNC (02),
    # allow_degrade 0, notify_queued 0, trace_id null, metadata {}, and revision 3's
    # admitted_at, effective_priority and degraded_from null.
    data = FAST.encode_request(minimal_request(request_id="", tenant_id="", prompt="", model="", user_tier=""))
    assert data[10:] == bytes([0, 0, 4, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0])
    return data


_BODY = 10  # offset of the body in a single-object message
_PRIORITY, _MAX_TOKENS, _CREATED_AT, _TASK_TIER, _ALLOW_DEGRADE, _TRACE_ID = 2, 5, 6, 9, 10, 12
_METADATA, _ADMITTED_AT, _EFFECTIVE_PRIORITY, _DEGRADED_FROM = 13, 14, 15, 16


def _patch(data: bytes, field_at: int, replacement: bytes) -> bytes:
    at = _BODY + field_at
    return data[:at] + replacement + data[at + 1 :]


@pytest.mark.parametrize("byte", [0x02, 0x03, 0x7F, 0xFF])
def test_boolean_must_be_0_or_1(byte):
    data = _patch(_minimal_request_bytes(), _ALLOW_DEGRADE, bytes([byte]))
    assert SLOW.decode_request(data).allow_degrade is True  # fastavro: any non-zero byte
    with pytest.raises(DecodeError) as info:
        FAST.decode_request(data)
    assert info.value.reason == "invalid_field"
    assert "LLMRequest.allow_degrade" in info.value.detail


@pytest.mark.parametrize(("field_at", "index", "slow_value"), [
    (_PRIORITY, -1, Priority.BACKGROUND),
    (_PRIORITY, -5, Priority.CRITICAL),
    (_TASK_TIER, -2, TaskTier.ASYNC),
])
def test_negative_enum_index(field_at, index, slow_value):
    data = _patch(_minimal_request_bytes(), field_at, zigzag(index))
    name = "priority" if field_at == _PRIORITY else "task_tier"
    assert getattr(SLOW.decode_request(data), name) is slow_value
    with pytest.raises(DecodeError) as info:
        FAST.decode_request(data)
    assert info.value.reason == "invalid_field"
    assert f"LLMRequest.{name}: negative enum index {index}" in info.value.detail


def test_negative_union_index():
    data = _patch(_minimal_request_bytes(), _TRACE_ID, zigzag(-1) + b"\x02a")
    assert SLOW.decode_request(data).trace_id == "a"  # fastavro: branch -1 is the string
    with pytest.raises(DecodeError) as info:
        FAST.decode_request(data)
    assert info.value.reason == "invalid_field"
    assert "negative union index" in info.value.detail


@pytest.mark.parametrize(("field_at", "index"), [(_PRIORITY, 5), (_PRIORITY, 2**40), (_TRACE_ID, 2), (_TRACE_ID, 77)])
def test_index_out_of_range_is_invalid_field_both_ways(field_at, index):
    data = _patch(_minimal_request_bytes(), field_at, zigzag(index))
    for codec in (FAST, SLOW):
        with pytest.raises(DecodeError) as info:
            codec.decode_request(data)
        assert info.value.reason == "invalid_field"


def test_non_canonical_indexes_are_read_like_fastavro():
    # NORMAL (2) as a 3-byte varint; trace_id branch 1 as a 2-byte varint.
    data = _patch(_minimal_request_bytes(), _PRIORITY, b"\x84\x80\x00")
    data = _patch(data, _TRACE_ID + 2, b"\x82\x00" + b"\x02x")  # (+2: the longer priority)
    assert FAST.decode_request(data) == SLOW.decode_request(data)
    assert FAST.decode_request(data).trace_id == "x"


def test_int_in_more_than_5_bytes():
    overlong_zero = b"\x80\x80\x80\x80\x80\x00"
    data = _patch(_minimal_request_bytes(), _MAX_TOKENS, overlong_zero)
    assert SLOW.decode_request(data).max_tokens == 0
    with pytest.raises(DecodeError) as info:
        FAST.decode_request(data)
    assert info.value.reason == "invalid_field"
    assert "LLMRequest.max_tokens: int encoded in 6 bytes" in info.value.detail
    # A 5-byte one is fine (non-canonical, but within the Avro int encoding).
    data = _patch(_minimal_request_bytes(), _MAX_TOKENS, b"\x80\x80\x80\x80\x00")
    assert FAST.decode_request(data).max_tokens == 0 == SLOW.decode_request(data).max_tokens


def test_int_out_of_range_is_named_like_fastavro():
    data = _patch(_minimal_request_bytes(), _MAX_TOKENS, zigzag(2**40))
    errors = []
    for codec in (FAST, SLOW):
        with pytest.raises(DecodeError) as info:
            codec.decode_request(data)
        errors.append((info.value.reason, info.value.detail))
    assert errors[0] == errors[1] == ("invalid_field", "LLMRequest.max_tokens: 1099511627776 is not a 32-bit int")


@pytest.mark.parametrize(
    ("varint", "what"),
    [
        (b"\x80" * 10 + b"\x00", "is longer than 10 bytes"),  # 11 bytes, value 0
        (b"\xff" * 9 + b"\x03", "exceeds 64 bits"),
        (b"\xfe" + b"\xff" * 8 + b"\x7f", "exceeds 64 bits"),
    ],
)
def test_overlong_varints(varint, what):
    data = _patch(_minimal_request_bytes(), _CREATED_AT, varint)
    SLOW.decode_request(data)  # fastavro wraps it around
    with pytest.raises(DecodeError) as info:
        FAST.decode_request(data)
    assert info.value.reason == "malformed"
    assert what in info.value.detail


def test_longs_of_every_length():
    """Every varint length (1..10 bytes), both signs, around each power of two."""
    rng = random.Random(99)
    values = {0, 2**63 - 1, -(2**63)}
    for k in range(63):
        values.update({2**k - 1, 2**k, 2**k + 1, -(2**k), -(2**k) - 1, rng.randrange(2**k, 2**(k + 1))})
    for value in sorted(values):
        data = _patch(_minimal_request_bytes(), _CREATED_AT, zigzag(value))
        assert FAST.decode_request(data).created_at == value, value
        assert FAST.encode_request(minimal_request(request_id="", tenant_id="", prompt="", model="",
                                                   user_tier="", created_at=value)) == data


def test_negative_string_length_is_truncated_like_fastavro():
    for length in (zigzag(-1), zigzag(-100), zigzag(-(2**40))):
        data = _patch(_minimal_request_bytes(), 0, length + b"abc")  # request_id
        for codec in (FAST, SLOW):
            with pytest.raises(DecodeError) as info:
                codec.decode_request(data)
            assert info.value.reason == "truncated"
            if codec is FAST:
                assert "LLMRequest.request_id: negative length" in info.value.detail
    data = FAST.encode_request(minimal_request(metadata={"k": "v"}))
    data = data.replace(b"\x02k\x02v", b"\x02k" + zigzag(-1) + b"v")
    for codec in (FAST, SLOW):
        with pytest.raises(DecodeError) as info:
            codec.decode_request(data)
        assert info.value.reason == "truncated"


def test_string_past_the_end_and_cut_utf8_are_truncated():
    data = FAST.encode_request(full_request(prompt="ü" * 100))
    at = data.index("ü".encode() * 100)
    for cut in (at + 1, at + 3, at + 199):  # inside a character, and one byte short
        with pytest.raises(DecodeError) as info:
            FAST.decode_request(data[:cut])
        assert info.value.reason == "truncated"
    # a length claiming far more than the message holds
    data = _patch(_minimal_request_bytes(), 0, zigzag(2**62))
    for codec in (FAST, SLOW):
        with pytest.raises(DecodeError) as info:
            codec.decode_request(data)
        assert info.value.reason == "truncated"


def test_invalid_utf8_is_malformed():
    data = FAST.encode_request(minimal_request(tenant_id="ab", metadata={"k": "v"}))
    for bad in (b"\xff\xfe", b"\xed\xa0"):  # invalid start byte; a UTF-16 surrogate
        broken = data.replace(b"\x04ab", b"\x04" + bad, 1)
        in_map = data.replace(b"\x02k\x02v", b"\x02k\x04" + bad, 1)
        for message in (broken, in_map):
            for codec in (FAST, SLOW):
                with pytest.raises(DecodeError) as info:
                    codec.decode_request(message)
                assert info.value.reason == "malformed"


# -- maps -----------------------------------------------------------------------------------------


def _request_with_map_bytes(map_bytes: bytes) -> bytes:
    return _patch(_minimal_request_bytes(), _METADATA, map_bytes)


def test_map_blocks_like_fastavro():
    cases = [
        zigzag(1) + b"\x02a\x02b" + zigzag(1) + b"\x02c\x02d" + b"\x00",  # two blocks
        zigzag(-2) + zigzag(8) + b"\x02a\x02b\x02c\x02d" + b"\x00",  # negative count + byte size
        zigzag(-1) + zigzag(999) + b"\x02a\x02b" + b"\x00",  # a wrong byte size is not used
        zigzag(-1) + b"\x80\x80\x01" + b"\x02a\x02b" + b"\x00",  # multi-byte byte size
        zigzag(2) + b"\x02a\x02b\x02a\x02c" + b"\x00",  # a duplicate key: the last one wins
        b"\x80\x00",  # a non-canonical zero count ends the map
    ]
    for map_bytes in cases:
        data = _request_with_map_bytes(map_bytes)
        assert FAST.decode_request(data) == SLOW.decode_request(data), map_bytes.hex()
    assert FAST.decode_request(_request_with_map_bytes(cases[4])).metadata == {"a": "c"}


def test_map_entry_cap_stops_at_the_block_count():
    # 65 entries claimed, and the message could hold them: limit_exceeded straight away
    entries = b"".join(b"\x04k%c\x02v" % (0x30 + i) for i in range(65))  # distinct keys k0, k1, ...
    data = _request_with_map_bytes(zigzag(65) + entries + b"\x00")
    for codec in (FAST, SLOW):
        with pytest.raises(DecodeError) as info:
            codec.decode_request(data)
        assert info.value.reason == "limit_exceeded"
        assert "LLMRequest.metadata" in info.value.detail and "64" in info.value.detail
    # split over blocks: the running total counts
    blocks = zigzag(40) + entries[:200] + zigzag(-25) + zigzag(125) + entries[200:325]  # 5 bytes an entry
    data = _request_with_map_bytes(blocks + b"\x00")
    with pytest.raises(DecodeError) as info:
        FAST.decode_request(data)
    assert info.value.reason == "limit_exceeded" and "65 entries" in info.value.detail
    # a count the rest of the message cannot hold: truncated
    data = _request_with_map_bytes(zigzag(65) + entries[:125])
    with pytest.raises(DecodeError) as info:
        FAST.decode_request(data)
    assert info.value.reason == "truncated"


def test_map_entry_cap_counts_duplicate_keys():
    data = _request_with_map_bytes(zigzag(65) + b"\x02k\x02v" * 65 + b"\x00")
    assert SLOW.decode_request(data).metadata == {"k": "v"}  # one entry after all
    with pytest.raises(DecodeError) as info:
        FAST.decode_request(data)
    assert info.value.reason == "limit_exceeded"


# -- caps ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tight() -> tuple[Codec, Codec, Codec]:
    """(lenient encoder, strict fast decoder, strict fastavro decoder)."""
    lenient = Codec(STORE, SerdeLimits(max_prompt_bytes=10**6, max_string_bytes=10**6, max_metadata_entries=10**6))
    limits = SerdeLimits(max_prompt_bytes=100, max_string_bytes=40, max_metadata_entries=3, max_output_bytes=70)
    return lenient, Codec(STORE, limits), Codec(STORE, limits, fast=False)


@pytest.mark.parametrize(
    "overrides",
    [
        {"prompt": "x" * 101},
        {"prompt": "€" * 34},
        {"tenant_id": "t" * 41},
        {"request_id": "é" * 21},
        {"model": "m" * 41},
        {"user_tier": "u" * 41},
        {"trace_id": "r" * 41},
        {"metadata": {"a": "1", "b": "2", "c": "3", "d": "4"}},
        {"metadata": {"k" * 41: "v"}},
        {"metadata": {"k": "v" * 41}},
        {"prompt": "x" * 101, "tenant_id": "t" * 41, "metadata": {"k": "v" * 41}},  # the same one is named
        {"prompt": "€" * 33, "metadata": {"k": "é" * 20}},  # at the caps: fine
    ],
)
def test_request_caps_match_fastavro(tight, overrides):
    lenient, fast, slow = tight
    data = lenient.encode_request(full_request(**overrides))
    results = []
    for codec in (fast, slow):
        try:
            results.append(codec.decode_request(data))
        except DecodeError as exc:
            results.append((exc.reason, exc.detail))
    assert results[0] == results[1]


@pytest.mark.parametrize(
    "overrides",
    [
        {"output": "o" * 71},
        {"output": "€" * 24},
        {"reason": "r" * 41},
        {"worker_id": "w" * 41},
        {"model": "m" * 41},
        {"metadata": {str(i): "" for i in range(4)}},
        {"prompt_tokens": 7, "output": "o" * 70},
    ],
)
def test_response_caps_match_fastavro(tight, overrides):
    lenient, fast, slow = tight
    data = lenient.encode_response(full_response(**overrides))
    results = []
    for codec in (fast, slow):
        try:
            results.append(codec.decode_response(data))
        except DecodeError as exc:
            results.append((exc.reason, exc.detail))
    assert results[0] == results[1]


def test_caps_of_a_large_body_are_checked():
    """Bodies longer than the smallest cap take the exact check; within the caps they decode."""
    big = full_request(prompt="p" * 200_000, metadata={"k": "v" * 1000})
    data = FAST.encode_request(big)
    assert len(data) > 65536
    assert FAST.decode_request(data) == big
    lenient = Codec(STORE, SerdeLimits(max_string_bytes=10**6, max_prompt_bytes=10**6))
    for overrides in ({"tenant_id": "t" * 70_000}, {"metadata": {"k": "v" * 70_000}}, {"prompt": "p" * 262_145}):
        data = lenient.encode_request(full_request(**overrides))
        errors = []
        for codec in (FAST, SLOW):
            with pytest.raises(DecodeError) as info:
                codec.decode_request(data)
            errors.append((info.value.reason, info.value.detail))
        assert errors[0] == errors[1] and errors[0][0] == "limit_exceeded"


def test_too_large_and_trailing_bytes():
    data = FAST.encode_request(full_request())
    small = Codec(STORE, SerdeLimits(max_record_bytes=len(data) - 1))
    with pytest.raises(DecodeError) as info:
        small.decode_request(data)
    assert info.value.reason == "too_large"
    assert small._fast_request.encode(full_request(), small._request_header) is None
    with pytest.raises(DecodeError) as info:
        FAST.decode_request(data + b"\x00")
    assert info.value.reason == "malformed" and "1 trailing bytes" in info.value.detail


def test_other_buffers_take_the_fast_path_too():
    req = full_request()
    data = FAST.encode_request(req)
    assert FAST.decode_request(bytearray(data)) == req == FAST.decode_request(memoryview(data))


# -- schema revisions and fallbacks -----------------------------------------------------------------


_REVISION_3_DEFAULTS = dict(admitted_at=None, effective_priority=None, degraded_from=None)


def test_older_writer_revision_goes_through_fastavro():
    rev1 = history_schema("llm_request", 1)
    record = full_request().to_record()
    data = b"\xc3\x01" + STORE.revisions("llm_request")[0].fingerprint.le_bytes + avro_body(rev1, record)
    expected = full_request(notify_queued=False, trace_id=None, **_REVISION_3_DEFAULTS)
    assert FAST.decode_request(data) == SLOW.decode_request(data) == expected
    rev2 = history_schema("llm_request", 2)
    data = b"\xc3\x01" + STORE.revisions("llm_request")[1].fingerprint.le_bytes + avro_body(rev2, record)
    assert FAST.decode_request(data) == SLOW.decode_request(data) == full_request(**_REVISION_3_DEFAULTS)


def test_older_response_writer_goes_through_fastavro():
    rev1 = history_schema("llm_response", 1)
    record = full_response().to_record()
    data = b"\xc3\x01" + STORE.revisions("llm_response")[0].fingerprint.le_bytes + avro_body(rev1, record)
    expected = full_response(queue_position=None, eta_ms=None)
    assert FAST.decode_response(data) == SLOW.decode_response(data) == expected


def test_gateway_fields_take_the_fast_path_and_match_fastavro():
    req = full_request()
    assert (req.admitted_at, req.effective_priority, req.degraded_from) != (None, None, None)
    data = _fast_encode(FAST, req)  # not a bail-out to fastavro
    assert data == SLOW.encode_request(req)
    assert FAST.decode_request(data) == SLOW.decode_request(data) == req
    queued = full_response(status=Status.QUEUED, output=None, queue_position=0, eta_ms=0)
    data = _fast_encode(FAST, queued)
    assert data == SLOW.encode_response(queued)
    back = FAST.decode_response(data)
    assert back == SLOW.decode_response(data) == queued and back.status is Status.QUEUED
    # The generated code reads the new fields itself; fastavro is not behind it.
    assert "degraded_from" in FAST._fast_request.decode_source
    assert "eta_ms" in FAST._fast_response.encode_source


def test_effective_priority_enum_guards_match_fastavro():
    data = _patch(_minimal_request_bytes(), _EFFECTIVE_PRIORITY, b"\x02" + zigzag(5))  # index 5 of 5 symbols
    for codec in (FAST, SLOW):
        with pytest.raises(DecodeError) as info:
            codec.decode_request(data)
        assert info.value.reason == "invalid_field"
    data = _patch(_minimal_request_bytes(), _EFFECTIVE_PRIORITY, b"\x02" + zigzag(-1))
    assert SLOW.decode_request(data).effective_priority is Priority.BACKGROUND  # fastavro: from the end
    with pytest.raises(DecodeError) as info:
        FAST.decode_request(data)
    assert "LLMRequest.effective_priority: negative enum index" in info.value.detail


def test_degraded_from_is_capped_like_the_other_strings(tight):
    lenient, fast, slow = tight
    data = lenient.encode_request(full_request(degraded_from="d" * 41))
    errors = []
    for codec in (fast, slow):
        with pytest.raises(DecodeError) as info:
            codec.decode_request(data)
        errors.append((info.value.reason, info.value.detail))
    assert errors[0] == errors[1] == ("limit_exceeded", "LLMRequest.degraded_from: 41 bytes exceed max_string_bytes=40")
    assert fast._fast_request.encode(full_request(degraded_from="d" * 41), fast._request_header) is None
    with pytest.raises(EncodeError, match="LLMRequest.degraded_from"):
        fast.encode_request(full_request(degraded_from="d" * 41))


@pytest.fixture(scope="module")
def old_codecs(tmp_path_factory) -> tuple[Codec, Codec]:
    """Fast and fastavro codecs whose current request schema is still revision 1."""
    root = pinned_schema_dir(tmp_path_factory.mktemp("old") / "schemas", llm_request=1, llm_response=1)
    store = SchemaStore.load(root, allow_older_current=True)
    return Codec(store), Codec(store, fast=False)


@settings(max_examples=100, deadline=None)
@given(requests)
def test_revision_1_as_current_schema(old_codecs, req):
    fast, slow = old_codecs
    assert fast.fast
    data = fast.encode_request(req)
    assert data == slow.encode_request(req)
    back = fast.decode_request(data)
    assert back == slow.decode_request(data)
    # revision 1 has none of the later fields: the model's defaults fill in
    assert back.notify_queued is False and back.trace_id is None
    assert (back.admitted_at, back.effective_priority, back.degraded_from) == (None, None, None)
    assert fast.decode_request(FAST.encode_request(req)) == slow.decode_request(FAST.encode_request(req))


@pytest.fixture(scope="module")
def rev2_codecs(tmp_path_factory) -> tuple[Codec, Codec]:
    """Fast and fastavro codecs of a consumer deployed before request revision 3."""
    root = pinned_schema_dir(tmp_path_factory.mktemp("rev2") / "schemas", llm_request=2, llm_response=1)
    store = SchemaStore.load(root, allow_older_current=True)
    return Codec(store), Codec(store, fast=False)


@settings(max_examples=100, deadline=None)
@given(requests)
def test_revision_2_and_3_agree_both_ways(rev2_codecs, req):
    fast, slow = rev2_codecs
    assert fast.fast
    # revision 3 writer, revision 2 reader: the gateway fields are dropped, the rest kept
    data = FAST.encode_request(req)
    back = fast.decode_request(data)
    assert back == slow.decode_request(data)
    assert back == dataclasses.replace(req, admitted_at=None, effective_priority=None, degraded_from=None)
    # revision 2 writer, revision 3 reader: they come back as null
    data = fast.encode_request(req)
    assert data == slow.encode_request(req)
    assert FAST.decode_request(data) == SLOW.decode_request(data) == back


def _compile(schema: dict, binding=REQUEST_BINDING):
    parsed = fastavro.parse_schema(copy.deepcopy(schema))
    return compile_codec(parsed, binding, FieldCaps(max_record_bytes=1 << 20))


def _with_field(schema: dict, name: str, avro_type) -> dict:
    schema = copy.deepcopy(schema)
    for f in schema["fields"]:
        if f["name"] == name:
            f["type"] = avro_type
            f.pop("default", None)
    return schema


_PRIORITY_ENUM = next(f["type"] for f in REQUEST_SCHEMA["fields"] if f["name"] == "priority")


def _with_priority_type(avro_type) -> dict:
    """``priority`` retyped; ``effective_priority`` then holds the Priority definition it refers to."""
    schema = _with_field(REQUEST_SCHEMA, "priority", avro_type)
    for f in schema["fields"]:
        if f["name"] == "effective_priority":
            f["type"] = ["null", copy.deepcopy(_PRIORITY_ENUM)]
    return schema


@pytest.mark.parametrize("avro_type", [
    "string",  # a plain string where the model holds an enum
    {"type": "enum", "name": "P", "symbols": ["CRITICAL", "URGENT"]},  # not a Priority
])
def test_unsupported_priority_types(avro_type):
    schema = _with_priority_type(avro_type)
    fastavro.parse_schema(copy.deepcopy(schema))  # a valid schema: only the generator refuses it
    with pytest.raises(UnsupportedSchema, match=r"LLMRequest\.priority"):
        _compile(schema)


def test_the_priority_definition_may_move_to_effective_priority():
    schema = _with_priority_type("io.llmq.v1.Priority")  # a reference to the moved definition
    moved = next(f for f in schema["fields"] if f["name"] == "effective_priority")
    schema["fields"].remove(moved)
    schema["fields"].insert(0, moved)  # a definition must come before its references
    fast = _compile(schema)
    for req in (full_request(), minimal_request()):
        data = fast.encode(req, b"")
        assert data == avro_body(schema, req.to_record())
        assert fast.decode(data, 0) == req


@pytest.mark.parametrize(
    ("name", "avro_type"),
    [
        ("max_tokens", "double"),
        ("prompt", "bytes"),
        ("metadata", {"type": "array", "items": "string"}),
        ("metadata", {"type": "map", "values": "long"}),
        ("trace_id", ["null", "string", "long"]),
        ("trace_id", ["string", "long"]),
        ("trace_id", {"type": "fixed", "name": "F", "size": 4}),
        ("trace_id", {"type": "record", "name": "R", "fields": [{"name": "x", "type": "string"}]}),
        ("prompt", {"type": "enum", "name": "E", "symbols": ["A"]}),  # an enum where the model has none
        ("effective_priority", ["null", "string"]),  # a string where the model holds an enum
    ],
)
def test_unsupported_schemas(name, avro_type):
    with pytest.raises(UnsupportedSchema):
        _compile(_with_field(REQUEST_SCHEMA, name, avro_type))


def test_unsupported_field_not_in_model():
    schema = copy.deepcopy(REQUEST_SCHEMA)
    schema["fields"].append({"name": "extra", "type": "string", "default": ""})
    with pytest.raises(UnsupportedSchema):
        _compile(schema)


def test_unsupported_schema_falls_back_to_fastavro(tmp_path):
    """A current schema the generator does not support: the codec works, with fastavro."""
    wider = _with_field(
        REQUEST_SCHEMA, "priority",
        {"type": "enum", "name": "Priority", "symbols": ["CRITICAL", "HIGH", "NORMAL", "LOW", "BACKGROUND", "URGENT"]},
    )
    root = write_schema_dir(
        tmp_path / "s",
        history={"llm_request": [wider], "llm_response": [history_schema("llm_response", 1)]},
        current={"llm_request": wider, "llm_response": history_schema("llm_response", 1)},
    )
    codec = Codec(SchemaStore.load(root))
    assert codec._fast_request is None and codec._fast_response is not None and not codec.fast
    req = full_request()
    assert codec.decode_request(codec.encode_request(req)) == req


def test_reordered_union_and_optional_fields(tmp_path):
    """A union with null second and fields in another order still match fastavro."""
    # Reversed, effective_priority comes first, so it must hold the Priority definition.
    schema = _with_priority_type("io.llmq.v1.Priority")
    for f in schema["fields"]:
        if f["name"] == "trace_id":
            f["type"] = ["string", "null"]
            f["default"] = ""
    schema["fields"].reverse()
    fast = _compile(schema)
    parsed = fastavro.parse_schema(copy.deepcopy(schema))
    for req in (full_request(), full_request(trace_id=None, effective_priority=None), minimal_request()):
        data = fast.encode(req, b"")
        assert data == avro_body(schema, req.to_record())
        assert fast.decode(data, 0) == req
        assert fastavro.schemaless_reader(io.BytesIO(data), parsed, None)["trace_id"] == req.trace_id


def test_response_binding_compiles_with_keyword_only_model():
    fast = _compile(RESPONSE_SCHEMA, RESPONSE_BINDING)
    resp = full_response()
    assert fast.decode(fast.encode(resp, b"xy"), 2) == resp


def test_fastpath_module_exports():
    assert set(fastpath.__all__) >= {"compile_codec", "UnsupportedSchema", "FastCodec", "FieldCaps"}
