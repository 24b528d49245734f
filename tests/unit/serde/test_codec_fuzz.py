"""Property tests: round trips, and that no input makes decode raise anything but DecodeError."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.errors import DecodeError
from pipeline.models import Priority, Request, Response, Status, TaskTier
from pipeline.serde import Codec, RegistryFormat, SchemaStore
from tests.unit.serde import SCHEMAS_DIR, full_request, full_response

STORE = SchemaStore.load(SCHEMAS_DIR)
REGISTRY = RegistryFormat.from_url("mock://fuzz")
CODEC = Codec(STORE, registry=REGISTRY)
TOPIC = "fuzz"

# Keep hypothesis quick and deterministic-ish on a busy machine.
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

int32 = st.integers(-(2**31), 2**31 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)
short_text = st.text(max_size=40)
metadata = st.dictionaries(short_text, short_text, max_size=8)

requests = st.builds(
    Request,
    request_id=st.uuids().map(str),
    tenant_id=short_text,
    priority=st.sampled_from(Priority),
    prompt=st.text(max_size=600),
    model=short_text,
    max_tokens=int32,
    created_at=int64,
    timeout_ms=int64,
    user_tier=short_text,
    task_tier=st.sampled_from(TaskTier),
    allow_degrade=st.booleans(),
    notify_queued=st.booleans(),
    trace_id=st.none() | short_text,
    metadata=metadata,
    admitted_at=st.none() | int64,
    effective_priority=st.none() | st.sampled_from(Priority),
    degraded_from=st.none() | short_text,
)

responses = st.builds(
    Response,
    request_id=st.uuids().map(str),
    tenant_id=short_text,
    status=st.sampled_from(Status),
    reason=st.none() | short_text,
    output=st.none() | st.text(max_size=600),
    prompt_tokens=int32,
    completion_tokens=int32,
    model=st.none() | short_text,
    degraded=st.booleans(),
    requested_priority=st.sampled_from(Priority),
    served_priority=st.none() | st.sampled_from(Priority),
    created_at=int64,
    admitted_at=st.none() | int64,
    started_at=st.none() | int64,
    finished_at=int64,
    worker_id=st.none() | short_text,
    retry_after_ms=st.none() | int64,
    metadata=metadata,
    queue_position=st.none() | int64,
    eta_ms=st.none() | int64,
)

wires = st.sampled_from(["single-object", "confluent"])


def _decode_only_raises_decode_error(decode, data: bytes) -> None:
    try:
        decode(data)
    except DecodeError:
        pass


@FUZZ
@given(requests, wires)
def test_request_round_trip(req, wire):
    assert CODEC.decode_request(CODEC.encode_request(req, wire=wire, topic=TOPIC)) == req


@FUZZ
@given(responses, wires)
def test_response_round_trip(resp, wire):
    assert CODEC.decode_response(CODEC.encode_response(resp, wire=wire, topic=TOPIC)) == resp


@settings(max_examples=60, deadline=None)
@given(requests, wires)
@example(full_request(), "single-object")
@example(full_request(), "confluent")
def test_every_prefix_of_a_request_is_truncated(req, wire):
    data = CODEC.encode_request(req, wire=wire, topic=TOPIC)
    for cut in range(len(data)):
        with pytest.raises(DecodeError) as info:
            CODEC.decode_request(data[:cut])
        assert info.value.reason == "truncated", (cut, info.value)


@settings(max_examples=60, deadline=None)
@given(responses, wires)
@example(full_response(), "single-object")
def test_every_prefix_of_a_response_is_truncated(resp, wire):
    data = CODEC.encode_response(resp, wire=wire, topic=TOPIC)
    for cut in range(len(data)):
        with pytest.raises(DecodeError) as info:
            CODEC.decode_response(data[:cut])
        assert info.value.reason == "truncated", (cut, info.value)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_only_raise_decode_error(data):
    _decode_only_raises_decode_error(CODEC.decode_request, data)
    _decode_only_raises_decode_error(CODEC.decode_response, data)


_REQUEST_HEADER = CODEC.encode_request(full_request())[:10]
_RESPONSE_HEADER = CODEC.encode_response(full_response())[:10]
_REQUEST_ID_HEADER = CODEC.encode_request(full_request(), wire="confluent", topic=TOPIC)[:5]


@settings(max_examples=1000, deadline=None)
@given(st.sampled_from([_REQUEST_HEADER, _REQUEST_ID_HEADER]), st.binary(max_size=300))
def test_arbitrary_request_bodies_only_raise_decode_error(header, body):
    _decode_only_raises_decode_error(CODEC.decode_request, header + body)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_response_bodies_only_raise_decode_error(body):
    _decode_only_raises_decode_error(CODEC.decode_response, _RESPONSE_HEADER + body)


@st.composite
def mutated(draw, messages):
    data = bytearray(draw(messages))
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, len(data) - 1))
        data[position] = draw(st.integers(0, 255))
    return bytes(data)


@settings(max_examples=500, deadline=None)
@given(mutated(requests.map(CODEC.encode_request)))
def test_mutated_requests_only_raise_decode_error(data):
    try:
        req = CODEC.decode_request(data)
    except DecodeError:
        return
    assert isinstance(req, Request)
    assert isinstance(req.priority, Priority) and isinstance(req.task_tier, TaskTier)


@settings(max_examples=500, deadline=None)
@given(mutated(responses.map(CODEC.encode_response)))
def test_mutated_responses_only_raise_decode_error(data):
    try:
        resp = CODEC.decode_response(data)
    except DecodeError:
        return
    assert isinstance(resp, Response)
    assert isinstance(resp.status, Status)
