"""The C twin (``_native.c``) against the generated Python code it stands in for.

The native codec is only a fast path: it must write exactly the bytes the generated
encoder writes, return exactly the object the generated decoder returns, and otherwise
return None so the generated code decides. It must never accept bytes the generated
decoder refuses. test_fastpath.py checks the pair (native first) against fastavro; here
each half is checked against the generated code directly, on valid records and on
mutilated bytes.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.errors import DecodeError
from pipeline.models import Priority, Request, Response, Status
from pipeline.serde import Codec, SchemaStore, SerdeLimits, fastpath
from tests.unit.serde import SCHEMAS_DIR, full_request, full_response, minimal_request, minimal_response
from tests.unit.serde.test_fastpath import requests, responses

pytestmark = pytest.mark.skipif(fastpath._native is None, reason="the C extension was not built (no C compiler?)")

STORE = SchemaStore.load(SCHEMAS_DIR)
NATIVE = Codec(STORE)
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _python_only() -> Codec:
    old = os.environ.get("LLMQ_NATIVE_CODEC")
    os.environ["LLMQ_NATIVE_CODEC"] = "0"
    try:
        return Codec(STORE)
    finally:
        if old is None:
            del os.environ["LLMQ_NATIVE_CODEC"]
        else:
            os.environ["LLMQ_NATIVE_CODEC"] = old


PYTHON = _python_only()
HEADER = 10  # single-object header: C3 01 + fingerprint


def _program(fast: fastpath.FastCodec) -> tuple:
    return fast.native_decode.args[0]


REQUEST_PROGRAM = _program(NATIVE._fast_request)
RESPONSE_PROGRAM = _program(NATIVE._fast_response)


def test_codecs_under_test_are_native_and_python():
    assert NATIVE._fast_request.native and NATIVE._fast_response.native
    assert not PYTHON._fast_request.native and not PYTHON._fast_response.native


def test_native_codec_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("LLMQ_NATIVE_CODEC", "0")
    assert not fastpath.native_available()
    monkeypatch.setenv("LLMQ_NATIVE_CODEC", "1")
    assert fastpath.native_available()


def _native_request_bytes(req: Request) -> bytes | None:
    return fastpath._native.encode(REQUEST_PROGRAM, req, NATIVE._fast_request_header)


@PROPERTY
@given(requests)
@example(full_request())
@example(minimal_request())
def test_request_bytes_equal_generated_code(req):
    expected = PYTHON._fast_request.encode(req, PYTHON._fast_request_header)
    assert _native_request_bytes(req) == expected


@PROPERTY
@given(responses)
@example(full_response())
@example(minimal_response())
def test_response_bytes_equal_generated_code(resp):
    expected = PYTHON._fast_response.encode(resp, PYTHON._fast_response_header)
    got = fastpath._native.encode(RESPONSE_PROGRAM, resp, NATIVE._fast_response_header)
    assert got == expected


@PROPERTY
@given(requests)
def test_request_decodes_to_the_same_object(req):
    data = PYTHON.encode_request(req)
    expected = PYTHON.decode_request(data)
    native = fastpath._native.decode(REQUEST_PROGRAM, data, HEADER)
    assert native == expected
    assert type(native) is Request


@PROPERTY
@given(responses)
def test_response_decodes_to_the_same_object(resp):
    data = PYTHON.encode_response(resp)
    native = fastpath._native.decode(RESPONSE_PROGRAM, data, HEADER)
    assert native == PYTHON.decode_response(data)


def _mutations(data: bytes, rng: random.Random, count: int):
    for _ in range(count):
        body = bytearray(data)
        kind = rng.randrange(4)
        if kind == 0:
            del body[rng.randrange(HEADER, len(body)):]
        elif kind == 1:
            for _ in range(rng.randint(1, 3)):
                body[rng.randrange(HEADER, len(body))] = rng.randrange(256)
        elif kind == 2:
            at = rng.randrange(HEADER, len(body) + 1)
            body[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        else:
            at = rng.randrange(HEADER, len(body))
            del body[at:at + rng.randint(1, 4)]
        yield bytes(body)


@pytest.mark.parametrize("kind", ["request", "response"])
def test_mutilated_bytes_are_never_accepted_where_python_refuses(kind):
    rng = random.Random(20261130)
    program = REQUEST_PROGRAM if kind == "request" else RESPONSE_PROGRAM
    python_decode = getattr(PYTHON, f"decode_{kind}")
    seeds = ([full_request(), minimal_request(), full_request(metadata={"a": "b", "é": "✓"}, trace_id=None)]
             if kind == "request" else
             [full_response(), minimal_response(), full_response(metadata={"k": "v" * 70}, reason=None)])
    accepted = refused = 0
    for seed in seeds:
        data = getattr(PYTHON, f"encode_{kind}")(seed)
        for mutated in _mutations(data, rng, 3000):
            native = fastpath._native.decode(program, mutated, HEADER)
            try:
                expected = python_decode(mutated)
            except DecodeError:
                assert native is None, mutated.hex()
                refused += 1
                continue
            if native is not None:
                assert native == expected, mutated.hex()
                accepted += 1
    assert accepted > 100 and refused > 1000  # both sides of the line were exercised


def test_non_canonical_varints_read_as_the_python_decoder_reads_them():
    data = bytearray(PYTHON.encode_request(minimal_request(max_tokens=1)))
    body = PYTHON.decode_request(bytes(data))
    # max_tokens=1 is the byte 02; the same value in two bytes is 82 00
    at = data.index(bytes([0x02]), HEADER + 4 + len(body.request_id) + len(body.tenant_id) + len(body.prompt))
    longer = bytes(data[:at]) + b"\x82\x00" + bytes(data[at + 1:])
    native = fastpath._native.decode(REQUEST_PROGRAM, longer, HEADER)
    assert native is not None and native == PYTHON.decode_request(longer)


@pytest.mark.parametrize("change", [
    {"prompt": "lone \ud800 surrogate"},
    {"max_tokens": True},
    {"max_tokens": 2**31},
    {"created_at": 2**63},
    {"priority": "NORMAL"},
    {"metadata": {"k": 1}},
    {"metadata": {f"k{i}": "v" for i in range(65)}},
    {"allow_degrade": 1},
    {"trace_id": 7},
])
def test_values_the_generated_encoder_refuses_are_left_to_it(change):
    req = full_request(**change)
    assert _native_request_bytes(req) is None
    assert PYTHON._fast_request.encode(req, PYTHON._fast_request_header) is None


def test_default_factories_and_defaults_fill_fields_the_schema_lacks():
    # Request and Response have no such fields today; the program still lists every slot.
    program = REQUEST_PROGRAM
    assert set(program[5]) == {f for f in Request.__dataclass_fields__}
    assert sorted(s for s in program[6] if isinstance(s, int)) == list(range(len(program[0])))


def test_wrong_argument_types_fall_back_instead_of_crashing():
    data = PYTHON.encode_request(full_request())
    assert fastpath._native.decode(REQUEST_PROGRAM, bytearray(data), HEADER) is None
    assert fastpath._native.decode(REQUEST_PROGRAM, data, -1) is None
    assert fastpath._native.decode(REQUEST_PROGRAM, data, len(data) + 1) is None
    assert fastpath._native.decode((), data, HEADER) is None
    assert fastpath._native.encode((), full_request(), b"") is None
    assert NATIVE.decode_request(data) == PYTHON.decode_request(data)


@pytest.mark.parametrize("change", [{"prompt": "x" * 262_145}, {"tenant_id": "t" * 65_537},
                                    {"metadata": {"k": "v" * 65_537}}])
def test_a_field_over_its_cap_is_named_by_the_python_decoder(change):
    big = full_request(**change)
    data = _encode_unchecked(big)
    assert fastpath._native.decode(REQUEST_PROGRAM, data, HEADER) is None  # too long for it
    ungated = REQUEST_PROGRAM[:-2] + (1 << 20, 1 << 20)
    assert fastpath._native.decode(ungated, data, HEADER) is None  # and its own cap check
    with pytest.raises(DecodeError) as native_err:
        NATIVE.decode_request(data)
    with pytest.raises(DecodeError) as python_err:
        PYTHON.decode_request(data)
    assert (native_err.value.reason, native_err.value.detail) == (python_err.value.reason, python_err.value.detail)


def _encode_unchecked(req: Request) -> bytes:
    """Bytes over a cap, as a hostile producer would write them (the codecs refuse to)."""
    loose = Codec(STORE, limits=SerdeLimits(max_prompt_bytes=1 << 19, max_string_bytes=1 << 19))
    return loose.encode_request(req)


def test_status_and_priority_members_round_trip():
    for status in Status:
        for priority in Priority:
            resp = full_response(status=status, requested_priority=priority, served_priority=priority)
            data = NATIVE.encode_response(resp)
            assert data == PYTHON.encode_response(resp)
            assert NATIVE.decode_response(data) == resp


def test_the_extension_is_built_wherever_a_c_compiler_is():
    # setup.py marks it optional, so a failed build only shows up as a slower codec: here.
    import shutil
    import sysconfig
    if shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc") is None:
        pytest.skip("no C compiler")
    assert fastpath._native is not None and fastpath._native.ABI == fastpath.NATIVE_ABI


def test_objects_are_filled_slot_by_slot_only_for_plain_slot_classes():
    from dataclasses import dataclass

    @dataclass(slots=True)
    class Plain:
        a: str
        b: int

    class WithProperty:
        __slots__ = ("a",)

        @property
        def b(self):
            return 1

    assert len(fastpath._native.slot_offsets(Plain, ("a", "b"))) == 2
    assert fastpath._native.slot_offsets(WithProperty, ("a", "b")) is None
    assert fastpath._native.slot_offsets(dict, ("a",)) is None
    assert REQUEST_PROGRAM[10] is not None and RESPONSE_PROGRAM[10] is not None


def test_subclasses_and_half_built_objects_are_read_safely():
    class Sub(Response):
        __slots__ = ()

    resp = Sub(**{f: getattr(full_response(), f) for f in Response.__dataclass_fields__})
    data = fastpath._native.encode(RESPONSE_PROGRAM, resp, NATIVE._fast_response_header)
    assert data == PYTHON._fast_response.encode(resp, PYTHON._fast_response_header)
    empty = object.__new__(Response)  # no slot set: the Python path's AttributeError, not a crash
    assert fastpath._native.encode(RESPONSE_PROGRAM, empty, NATIVE._fast_response_header) is None
    assert PYTHON._fast_response.encode(empty, PYTHON._fast_response_header) is None


def test_model_fields_the_schema_lacks_get_their_defaults_and_fresh_factories():
    from dataclasses import dataclass, field

    import fastavro

    @dataclass(slots=True)
    class Thing:
        name: str
        size: int
        tags: list = field(default_factory=list)
        level: int = 7

    parsed = fastavro.parse_schema({"type": "record", "name": "Thing", "fields": [
        {"name": "name", "type": "string"}, {"name": "size", "type": "long"}]})
    codec = fastpath.compile_codec(parsed, fastpath.ModelBinding(Thing, {}), fastpath.FieldCaps(max_record_bytes=1 << 20))
    assert codec.native
    data = codec.encode(Thing("x", 3), b"")
    first, second = codec.native_decode(data, 0), codec.native_decode(data, 0)
    assert first == Thing("x", 3, [], 7) == codec.python_decode(data, 0)
    assert first.tags is not second.tags  # a fresh list per object
