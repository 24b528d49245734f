"""Codec: single-object round trips, schema evolution, and every decode guard."""

from __future__ import annotations

import copy
import time

import pytest

from pipeline.errors import DecodeError, EncodeError, SchemaNotFoundError
from pipeline.models import Priority, Request, Response, Status, TaskTier
from pipeline.serde import SINGLE_OBJECT_MAGIC, Codec, SchemaStore, SerdeLimits
from pipeline.serde.codec import _default_codec
from pipeline.serde.fingerprint import schema_fingerprint
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


@pytest.fixture(scope="module")
def store() -> SchemaStore:
    return SchemaStore.load(SCHEMAS_DIR)


@pytest.fixture(scope="module")
def codec(store) -> Codec:
    return Codec(store)


def _header(schema) -> bytes:
    return SINGLE_OBJECT_MAGIC + schema_fingerprint(schema).le_bytes


def _reason(excinfo) -> str:
    return excinfo.value.reason


# -- round trips ------------------------------------------------------------------


@pytest.mark.parametrize("make", [full_request, minimal_request], ids=["all-optional-set", "all-optional-unset"])
def test_request_round_trip(codec, make):
    req = make()
    assert codec.decode_request(codec.encode_request(req)) == req


@pytest.mark.parametrize("make", [full_response, minimal_response], ids=["all-optional-set", "all-optional-unset"])
def test_response_round_trip(codec, make):
    resp = make()
    assert codec.decode_response(codec.encode_response(resp)) == resp


def test_round_trip_of_new_objects(codec):
    req = Request.new("tenant", "x" * 1024, priority="critical", metadata={"k": "v"})
    back = codec.decode_request(codec.encode_request(req))
    assert back == req
    assert back.priority is Priority.CRITICAL and back.task_tier is TaskTier.ASYNC
    assert type(back.created_at) is int
    resp = Response.for_request(req, Status.EXPIRED, reason="expired: deadline passed")
    assert codec.decode_response(codec.encode_response(resp)) == resp


def test_round_trip_of_extreme_values(codec):
    req = full_request(max_tokens=2**31 - 1, created_at=-(2**63), timeout_ms=2**63 - 1, prompt="\x00" * 3)
    assert codec.decode_request(codec.encode_request(req)) == req
    resp = full_response(prompt_tokens=-(2**31), retry_after_ms=2**63 - 1, output="")
    assert codec.decode_response(codec.encode_response(resp)) == resp


@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_decode_accepts_other_buffers(codec, kind):
    req = full_request()
    assert codec.decode_request(kind(codec.encode_request(req))) == req


def test_single_object_header(codec, store):
    data = codec.encode_request(full_request())
    current = load_json(SCHEMAS_DIR / "llm_request.avsc")
    fp = schema_fingerprint(current)
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == fp.value.to_bytes(8, "little")
    assert data[2:10] == store.current_revision("llm_request").fingerprint.le_bytes
    assert data[10:] == avro_body(current, full_request().to_record())
    resp_data = codec.encode_response(full_response())
    assert resp_data[:10] == _header(load_json(SCHEMAS_DIR / "llm_response.avsc"))
    assert Codec.wire_format(data) == "single-object"
    assert Codec.wire_format(b"\x00abc") == "confluent"
    assert Codec.wire_format(b"zz") == "unknown"


def test_encoding_is_deterministic(codec):
    assert codec.encode_request(full_request()) == codec.encode_request(full_request())


def test_default_codec_is_cached():
    _default_codec.cache_clear()
    try:
        assert Codec.default() is Codec.default()
        assert Codec.default().limits == SerdeLimits()
    finally:
        _default_codec.cache_clear()


# -- schema evolution ---------------------------------------------------------------

# What a reader of the current revision fills in for fields an older writer lacks.
_REQUEST_REV3_DEFAULTS = dict(messages=[], temperature=None, top_p=None, stop=[], user=None, stream=False,
                              reply_to=None, reply_partition=None)
_REQUEST_REV2_DEFAULTS = dict(admitted_at=None, effective_priority=None, degraded_from=None, **_REQUEST_REV3_DEFAULTS)
_REQUEST_REV1_DEFAULTS = dict(notify_queued=False, trace_id=None, **_REQUEST_REV2_DEFAULTS)
_RESPONSE_REV2_DEFAULTS = dict(finish_reason=None, usage_estimated=False)
_RESPONSE_REV1_DEFAULTS = dict(queue_position=None, eta_ms=None, **_RESPONSE_REV2_DEFAULTS)


def test_revision_1_writer_decodes_with_current_reader(codec):
    rev1 = history_schema("llm_request", 1)
    data = _header(rev1) + avro_body(rev1, full_request().to_record())  # fastavro drops the later fields
    assert codec.decode_request(data) == full_request(**_REQUEST_REV1_DEFAULTS)


def test_revision_2_writer_decodes_with_current_reader(codec):
    rev2 = history_schema("llm_request", 2)
    data = _header(rev2) + avro_body(rev2, full_request().to_record())
    req = codec.decode_request(data)
    assert req == full_request(**_REQUEST_REV2_DEFAULTS)
    assert req.serving_priority is req.priority  # no gateway: the requested band


def test_revision_3_writer_decodes_with_current_reader(codec):
    rev3 = history_schema("llm_request", 3)
    data = _header(rev3) + avro_body(rev3, full_request().to_record())
    req = codec.decode_request(data)
    assert req == full_request(**_REQUEST_REV3_DEFAULTS)
    # An older writer's request is one user message, answered on the default topic.
    assert req.chat_messages() == [{"role": "user", "content": req.prompt}]
    assert (req.reply_to, req.reply_partition, req.stream) == (None, None, False)


def _pinned(tmp_path_factory, label: str, **revisions: int) -> Codec:
    root = pinned_schema_dir(tmp_path_factory.mktemp(label) / "schemas", **revisions)
    return Codec(SchemaStore.load(root, allow_older_current=True))


@pytest.fixture(scope="module")
def old_codec(tmp_path_factory) -> Codec:
    """A consumer whose current schemas are still revision 1 (request and response)."""
    return _pinned(tmp_path_factory, "old", llm_request=1, llm_response=1)


@pytest.fixture(scope="module")
def rev2_codec(tmp_path_factory) -> Codec:
    """A consumer deployed before the gateway: request revision 2, response revision 1."""
    return _pinned(tmp_path_factory, "rev2", llm_request=2, llm_response=1)


@pytest.fixture(scope="module")
def rev3_codec(tmp_path_factory) -> Codec:
    """A consumer deployed before the OpenAI shape: request revision 3, response revision 2."""
    return _pinned(tmp_path_factory, "rev3", llm_request=3, llm_response=2)


def test_current_writer_decodes_with_revision_1_reader(codec, old_codec):
    data = codec.encode_request(full_request())
    # Revision 1 knows none of the later fields: they come back as defaults.
    assert old_codec.decode_request(data) == full_request(**_REQUEST_REV1_DEFAULTS)


def test_current_writer_decodes_with_revision_2_reader(codec, rev2_codec):
    data = codec.encode_request(full_request())
    assert rev2_codec.decode_request(data) == full_request(**_REQUEST_REV2_DEFAULTS)


def test_revision_4_writer_decodes_with_revision_3_reader(codec, rev3_codec):
    data = codec.encode_request(full_request())
    assert data[:10] == _header(history_schema("llm_request", 4))
    assert rev3_codec.decode_request(data) == full_request(**_REQUEST_REV3_DEFAULTS)


def test_a_conversation_reaches_an_older_reader_as_its_prompt(codec, rev3_codec, old_codec):
    req = Request.new("tenant", messages=[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "What is Avro?"}], temperature=0.2)
    data = codec.encode_request(req)
    for older in (rev3_codec, old_codec):
        seen = older.decode_request(data)
        assert seen.prompt == "system: Be brief.\nuser: What is Avro?"
        assert seen.messages == [] and seen.temperature is None
    assert codec.decode_request(data).messages == req.messages


def test_revision_1_codec_writes_revision_1(old_codec, codec):
    data = old_codec.encode_request(full_request())
    assert data[:10] == _header(history_schema("llm_request", 1))
    assert codec.decode_request(data) == full_request(**_REQUEST_REV1_DEFAULTS)


def test_revision_2_codec_writes_revision_2(rev2_codec, codec):
    data = rev2_codec.encode_request(full_request())
    assert data[:10] == _header(history_schema("llm_request", 2))
    assert codec.decode_request(data) == full_request(**_REQUEST_REV2_DEFAULTS)


def test_revision_3_codec_writes_revision_3(rev3_codec, codec):
    data = rev3_codec.encode_request(full_request())
    assert data[:10] == _header(history_schema("llm_request", 3))
    assert codec.decode_request(data) == full_request(**_REQUEST_REV3_DEFAULTS)


def test_response_revision_1_writer_decodes_with_current_reader(codec, old_codec):
    data = old_codec.encode_response(full_response())
    assert data[:10] == _header(history_schema("llm_response", 1))
    assert codec.decode_response(data) == full_response(**_RESPONSE_REV1_DEFAULTS)


def test_response_revision_2_writer_decodes_with_current_reader(codec, rev3_codec):
    data = rev3_codec.encode_response(full_response())
    assert data[:10] == _header(history_schema("llm_response", 2))
    back = codec.decode_response(data)
    assert back == full_response(**_RESPONSE_REV2_DEFAULTS)
    assert back.finish_reason is None and back.usage_estimated is False


def test_response_revision_3_writer_decodes_with_older_readers(codec, old_codec, rev3_codec):
    data = codec.encode_response(full_response())
    assert data[:10] == _header(history_schema("llm_response", 3))
    assert rev3_codec.decode_response(data) == full_response(**_RESPONSE_REV2_DEFAULTS)
    assert old_codec.decode_response(data) == full_response(**_RESPONSE_REV1_DEFAULTS)


def test_queued_decodes_with_the_current_reader_only(codec, old_codec):
    queued = full_response(status=Status.QUEUED, output=None, queue_position=3, eta_ms=1_500)
    data = codec.encode_response(queued)
    back = codec.decode_response(data)
    assert back == queued and back.status is Status.QUEUED and not back.status.is_terminal
    # Revision 1 has no QUEUED and no enum default to fall back on.
    with pytest.raises(DecodeError) as info:
        old_codec.decode_response(data)
    assert _reason(info) == "invalid_field" and "QUEUED" in str(info.value)


def test_status_indexes_of_revision_1_are_unchanged(codec):
    # QUEUED was appended: every revision 1 symbol keeps its index, so the bytes agree.
    rev1, rev2 = history_schema("llm_response", 1), history_schema("llm_response", 2)
    for status in Status:
        if status is Status.QUEUED:
            continue
        record = full_response(status=status).to_record()
        assert avro_body(rev1, record) == avro_body(rev2, record)[: len(avro_body(rev1, record))]


# -- guards -------------------------------------------------------------------------


def test_too_large_is_checked_before_anything_else(store):
    small = Codec(store, SerdeLimits(max_record_bytes=100))
    with pytest.raises(DecodeError) as info:
        small.decode_request(b"\xff" * 101)  # bad magic too, but size comes first
    assert _reason(info) == "too_large"
    with pytest.raises(DecodeError) as info:
        small.decode_request(b"\xc3\x01" + b"\x00" * 99)
    assert _reason(info) == "too_large"


def test_too_large_with_default_limits(codec):
    with pytest.raises(DecodeError) as info:
        codec.decode_request(b"\xc3\x01" + bytes(1_048_576))
    assert _reason(info) == "too_large"


def test_encode_refuses_what_decode_would_refuse(store):
    small = Codec(store, SerdeLimits(max_record_bytes=200))
    with pytest.raises(EncodeError, match="max_record_bytes"):
        small.encode_request(full_request(prompt="x" * 300))


@pytest.mark.parametrize("cut", [0, 1, 2, 5, 9, 10, 11, 20, 48, -5, -2, -1])
def test_truncated_at_several_points(codec, cut):
    data = codec.encode_request(full_request())
    with pytest.raises(DecodeError) as info:
        codec.decode_request(data[:cut])
    assert _reason(info) == "truncated"


@pytest.mark.parametrize("data", [b"\x01", b"\xff\xff", b"{}", b"\xc3\x02" + bytes(20), b"\xc4\x01" + bytes(20)])
def test_bad_magic(codec, data):
    with pytest.raises(DecodeError) as info:
        codec.decode_request(data)
    assert _reason(info) == "bad_magic"


def test_unknown_fingerprint(codec):
    data = codec.encode_request(full_request())
    forged = data[:2] + b"\x12\x34\x56\x78\x9a\xbc\xde\xf0" + data[10:]
    with pytest.raises(SchemaNotFoundError) as info:
        codec.decode_request(forged)
    assert _reason(info) == "unknown_fingerprint"


def test_fingerprint_of_the_other_record(codec):
    data = codec.encode_response(full_response())
    with pytest.raises(SchemaNotFoundError) as info:
        codec.decode_request(data)
    assert _reason(info) == "unknown_fingerprint"
    assert "LLMResponse" in str(info.value)


def test_unknown_schema_id_without_registry(codec):
    with pytest.raises(SchemaNotFoundError) as info:
        codec.decode_request(b"\x00\x00\x00\x00\x07" + bytes(20))
    assert _reason(info) == "unknown_schema_id"


def test_trailing_bytes(codec):
    data = codec.encode_request(full_request())
    for extra in (b"\x00", b"junk"):
        with pytest.raises(DecodeError) as info:
            codec.decode_request(data + extra)
        assert _reason(info) == "malformed"
        assert "trailing" in str(info.value)


def test_invalid_utf8(codec):
    data = codec.encode_request(minimal_request(tenant_id="ab"))
    tenant_at = data.index(b"\x04ab")  # length 2, then the bytes
    broken = data[: tenant_at + 1] + b"\xff\xfe" + data[tenant_at + 3 :]
    with pytest.raises(DecodeError) as info:
        codec.decode_request(broken)
    assert _reason(info) == "malformed"


def test_not_bytes(codec):
    for value in (None, "text", 42):
        with pytest.raises(DecodeError) as info:
            codec.decode_request(value)  # type: ignore[arg-type]
        assert _reason(info) == "malformed"


@pytest.fixture(scope="module")
def tight() -> tuple[Codec, Codec]:
    """(lenient encoder, strict decoder) so over-cap messages can be produced."""
    store = SchemaStore.load(SCHEMAS_DIR)
    lenient = Codec(store, SerdeLimits(max_prompt_bytes=10**6, max_string_bytes=10**6, max_metadata_entries=10**6,
                                       max_messages=10**6, max_array_items=10**6))
    strict = Codec(
        store, SerdeLimits(max_prompt_bytes=100, max_string_bytes=40, max_metadata_entries=3, max_output_bytes=70,
                           max_messages=3, max_array_items=2)
    )
    return lenient, strict


def _messages(*contents: str, role: str = "user", **extra) -> list[dict]:
    return [{"role": role, "content": c, **extra} for c in contents]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"prompt": "x" * 101}, "prompt"),
        ({"prompt": "€" * 34}, "prompt"),  # 34 characters, 102 bytes
        ({"tenant_id": "t" * 41}, "tenant_id"),
        ({"request_id": "é" * 21}, "request_id"),
        ({"model": "m" * 41}, "model"),
        ({"user_tier": "u" * 41}, "user_tier"),
        ({"trace_id": "r" * 41}, "trace_id"),
        ({"metadata": {"a": "1", "b": "2", "c": "3", "d": "4"}}, "metadata"),
        ({"metadata": {"k" * 41: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 41}}, "metadata['k']"),
        # A message's content is prompt text (the prompt's cap); its role and name are not.
        ({"messages": _messages("c" * 101)}, "messages[].content: 101 bytes exceed max_prompt_bytes=100"),
        ({"messages": _messages("c", role="r" * 41)}, "messages[].role: 41 bytes exceed max_string_bytes=40"),
        ({"messages": _messages("c", name="n" * 41)}, "messages[].name"),
        ({"messages": _messages("a", "b", "c", "d")}, "messages: 4 items exceed max_messages=3"),
        ({"stop": ["s" * 41]}, "stop[]: 41 bytes exceed max_string_bytes=40"),
        ({"stop": ["a", "b", "c"]}, "stop: 3 items exceed max_array_items=2"),
        ({"user": "u" * 41}, "user"),
        ({"reply_to": "r" * 41}, "reply_to"),
    ],
)
def test_request_field_caps(tight, overrides, field):
    lenient, strict = tight
    data = lenient.encode_request(full_request(**overrides))
    with pytest.raises(DecodeError) as info:
        strict.decode_request(data)
    assert _reason(info) == "limit_exceeded"
    assert f"LLMRequest.{field}" in info.value.detail
    with pytest.raises(EncodeError, match=f"LLMRequest.{field.split('[')[0]}"):
        strict.encode_request(full_request(**overrides))


def test_caps_count_bytes_not_characters(tight):
    lenient, strict = tight
    req = full_request(prompt="€" * 33, metadata={"k": "é" * 20})  # 99 and 40 bytes: at the caps
    assert strict.decode_request(lenient.encode_request(req)) == req


def test_requests_at_the_message_and_array_caps_pass(tight):
    lenient, strict = tight
    req = full_request(messages=_messages("€" * 33, "b", "c"), stop=["s" * 40, "t"])
    assert strict.decode_request(lenient.encode_request(req)) == req
    assert strict.decode_request(strict.encode_request(req)) == req


def test_the_message_count_cap_counts_every_block(tight, codec):
    lenient, strict = tight
    data = lenient.encode_request(minimal_request(messages=_messages("a", "b"), stop=["x"]))
    one_block = zigzag(2) + b"\x08user\x02a\x00" + b"\x08user\x02b\x00" + zigzag(0)
    assert one_block in data
    # The same two messages in two blocks, then four in four: the running total is capped.
    two = data.replace(one_block, zigzag(1) + b"\x08user\x02a\x00" + zigzag(1) + b"\x08user\x02b\x00" + zigzag(0))
    assert strict.decode_request(two).messages == _messages("a", "b")
    four = data.replace(one_block, (zigzag(1) + b"\x08user\x02a\x00") * 4 + zigzag(0))
    with pytest.raises(DecodeError) as info:
        strict.decode_request(four)
    assert _reason(info) == "limit_exceeded" and "LLMRequest.messages: 4 items exceed max_messages=3" in info.value.detail
    assert len(codec.decode_request(four).messages) == 4  # the default cap is 256


def test_default_message_cap(codec):
    lenient = Codec(codec.store, SerdeLimits(max_messages=1000))
    data = lenient.encode_request(minimal_request(messages=_messages(*("m" for _ in range(257)))))
    with pytest.raises(DecodeError) as info:
        codec.decode_request(data)
    assert _reason(info) == "limit_exceeded" and "max_messages=256" in info.value.detail
    with pytest.raises(EncodeError, match="max_messages=256"):
        codec.encode_request(minimal_request(messages=_messages(*("m" for _ in range(257)))))
    ok = minimal_request(messages=_messages(*("m" for _ in range(256))))
    assert codec.decode_request(codec.encode_request(ok)) == ok


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"output": "o" * 71}, "output"),
        ({"output": "€" * 24}, "output"),
        ({"reason": "r" * 41}, "reason"),
        ({"worker_id": "w" * 41}, "worker_id"),
        ({"model": "m" * 41}, "model"),
        ({"metadata": {str(i): "" for i in range(4)}}, "metadata"),
        ({"finish_reason": "f" * 41}, "finish_reason"),
    ],
)
def test_response_field_caps(tight, overrides, field):
    lenient, strict = tight
    data = lenient.encode_response(full_response(**overrides))
    with pytest.raises(DecodeError) as info:
        strict.decode_response(data)
    assert _reason(info) == "limit_exceeded"
    assert f"LLMResponse.{field}" in info.value.detail


def test_default_metadata_entry_cap(codec):
    lenient = Codec(codec.store, SerdeLimits(max_metadata_entries=1000))
    data = lenient.encode_request(full_request(metadata={f"k{i}": "v" for i in range(65)}))
    with pytest.raises(DecodeError) as info:
        codec.decode_request(data)
    assert _reason(info) == "limit_exceeded"
    assert "64" in info.value.detail


def _with_priority_symbols(schema: dict, symbols: list[str]) -> dict:
    schema = copy.deepcopy(schema)
    for f in schema["fields"]:
        if f["name"] == "priority":
            f["type"]["symbols"] = symbols
    return schema


def test_bad_enum_index(codec):
    current = load_json(SCHEMAS_DIR / "llm_request.avsc")
    eight = _with_priority_symbols(current, ["CRITICAL", "HIGH", "NORMAL", "LOW", "BACKGROUND", "X5", "X6", "X7"])
    body = avro_body(eight, {**full_request().to_record(), "priority": "X7"})  # index 7 of 5
    with pytest.raises(DecodeError) as info:
        codec.decode_request(_header(current) + body)
    assert _reason(info) == "invalid_field"


# The last fields of a minimal request, one byte each (all zero): metadata {}, then revision
# 3's unions, then revision 4's fields.
_TAIL = ("metadata", "admitted_at", "effective_priority", "degraded_from", "messages", "temperature", "top_p",
         "stop", "user", "stream", "reply_to", "reply_partition")
_UNIONS = ("admitted_at", "effective_priority", "degraded_from", "temperature", "top_p", "user", "reply_to",
           "reply_partition")


@pytest.mark.parametrize("field", _UNIONS)
def test_bad_union_index(codec, field):
    data = codec.encode_request(minimal_request())
    assert data.endswith(bytes(len(_TAIL)))
    at = len(data) - len(_TAIL) + _TAIL.index(field)
    with pytest.raises(DecodeError) as info:
        codec.decode_request(data[:at] + zigzag(9) + data[at + 1:])
    assert _reason(info) == "invalid_field" and f"LLMRequest.{field}" in info.value.detail


def test_negative_enum_index(codec, store):
    """fastavro alone would read index -1 as the last symbol (BACKGROUND)."""
    data = codec.encode_request(minimal_request())
    prio_at = 10 + 1 + 36 + 1 + 1  # header, request_id, tenant "t"
    assert data[prio_at] == 4  # NORMAL = index 2
    forged = data[:prio_at] + zigzag(-1) + data[prio_at + 1 :]
    with pytest.raises(DecodeError) as info:
        codec.decode_request(forged)
    assert _reason(info) == "invalid_field"
    assert "LLMRequest.priority" in info.value.detail


def test_writer_symbol_unknown_to_reader(tmp_path):
    current = load_json(SCHEMAS_DIR / "llm_request.avsc")
    wider = _with_priority_symbols(current, ["CRITICAL", "HIGH", "NORMAL", "LOW", "BACKGROUND", "URGENT"])
    root = write_schema_dir(
        tmp_path / "s",
        history={"llm_request": [wider, current], "llm_response": [history_schema("llm_response", 1)]},
        current={"llm_request": current, "llm_response": history_schema("llm_response", 1)},
    )
    codec = Codec(SchemaStore.load(root))
    ok = _header(wider) + avro_body(wider, full_request().to_record())
    assert codec.decode_request(ok) == full_request()
    bad = _header(wider) + avro_body(wider, {**full_request().to_record(), "priority": "URGENT"})
    with pytest.raises(DecodeError) as info:
        codec.decode_request(bad)
    assert _reason(info) == "invalid_field"
    assert "URGENT" in str(info.value)


def test_reader_symbol_unknown_to_python(tmp_path):
    wider = _with_priority_symbols(
        load_json(SCHEMAS_DIR / "llm_request.avsc"), ["CRITICAL", "HIGH", "NORMAL", "LOW", "BACKGROUND", "URGENT"]
    )
    root = write_schema_dir(
        tmp_path / "s",
        history={"llm_request": [wider], "llm_response": [history_schema("llm_response", 1)]},
        current={"llm_request": wider, "llm_response": history_schema("llm_response", 1)},
    )
    codec = Codec(SchemaStore.load(root))
    data = _header(wider) + avro_body(wider, {**full_request().to_record(), "priority": "URGENT"})
    with pytest.raises(DecodeError) as info:
        codec.decode_request(data)
    assert _reason(info) == "invalid_field"


def test_int_field_out_of_32_bit_range(codec):
    current = load_json(SCHEMAS_DIR / "llm_request.avsc")
    as_long = copy.deepcopy(current)
    next(f for f in as_long["fields"] if f["name"] == "max_tokens")["type"] = "long"
    data = _header(current) + avro_body(as_long, {**full_request().to_record(), "max_tokens": 2**40})
    with pytest.raises(DecodeError) as info:
        codec.decode_request(data)
    assert _reason(info) == "invalid_field"
    assert "max_tokens" in info.value.detail


def test_huge_map_count_is_rejected_fast(codec):
    # Every field at its smallest (one byte each), then a map block count of 2**62
    # where the empty metadata map's terminating zero was.
    data = codec.encode_request(minimal_request(request_id="", tenant_id="", prompt="", model="", user_tier=""))
    assert len(data) == 10 + 25 and data[-len(_TAIL):] == bytes(len(_TAIL))
    start = time.perf_counter()
    for field in ("metadata", "messages", "stop"):  # a map and two arrays
        at = len(data) - len(_TAIL) + _TAIL.index(field)
        for count in (2**62, -(2**62), 2**63 - 1, -(2**63)):
            with pytest.raises(DecodeError) as info:
                codec.decode_request(data[:at] + zigzag(count) + data[at + 1:])
            assert _reason(info) == "truncated" and f"LLMRequest.{field}" in info.value.detail
    assert time.perf_counter() - start < 0.1


def test_huge_array_count_is_rejected_fast(tmp_path):
    tagged = {
        "type": "record",
        "name": "LLMRequest",
        "namespace": "io.llmq.v1",
        "fields": [{"name": "tags", "type": {"type": "array", "items": "long"}}],
    }
    root = write_schema_dir(
        tmp_path / "s",
        history={"llm_request": [tagged], "llm_response": [history_schema("llm_response", 1)]},
        current={"llm_request": tagged, "llm_response": history_schema("llm_response", 1)},
    )
    codec = Codec(SchemaStore.load(root))
    start = time.perf_counter()
    for count in (2**62, -(2**62)):
        data = _header(tagged) + zigzag(count)
        assert len(data) <= 20
        with pytest.raises(DecodeError) as info:
            codec.decode_request(data)
        assert _reason(info) == "truncated"
    assert time.perf_counter() - start < 0.1


# -- encode errors ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"prompt": 42}, "prompt"),
        ({"tenant_id": None}, "tenant_id"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"created_at": 2**64}, "created_at"),
        ({"trace_id": 7}, "trace_id"),
        ({"admitted_at": True}, "admitted_at"),
        ({"admitted_at": "soon"}, "admitted_at"),
        ({"degraded_from": 7}, "degraded_from"),
        ({"messages": [{"role": "user"}]}, "ChatMessage.content"),
        ({"messages": [{"role": "user", "content": 7}]}, "ChatMessage.content"),
        ({"messages": ["hello"]}, "messages"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": [0.5]}, "top_p"),
        # fastavro would write these as ["E", "N", "D"], ["a"], false and true.
        ({"stop": "END"}, "LLMRequest.stop: a str is not a list"),
        ({"stop": {"a": 1}}, "LLMRequest.stop: a dict is not a list"),
        ({"messages": "hello"}, "LLMRequest.messages: a str is not a list"),
        ({"stream": None}, "LLMRequest.stream: None is not a bool"),
        ({"allow_degrade": "yes"}, "LLMRequest.allow_degrade: 'yes' is not a bool"),
        ({"notify_queued": 1}, "LLMRequest.notify_queued"),
        ({"max_tokens": None}, "LLMRequest.max_tokens: None is not an int"),
        ({"stop": [None]}, "stop"),
        ({"reply_partition": True}, "reply_partition"),
        ({"reply_partition": 1.0}, "reply_partition"),
        ({"reply_partition": 2**31}, "reply_partition"),
    ],
)
def test_encode_errors_name_the_record_and_field(codec, overrides, needle):
    with pytest.raises(EncodeError) as info:
        codec.encode_request(full_request(**overrides))
    assert "LLMRequest" in str(info.value)
    assert needle in str(info.value)


def test_encode_rejects_a_plain_string_for_effective_priority(codec):
    with pytest.raises(EncodeError, match="LLMRequest"):
        codec.encode_request(full_request(effective_priority="LOW"))


def test_encode_rejects_plain_strings_for_enums(codec):
    req = full_request()
    req.priority = "HIGH"  # type: ignore[assignment]
    with pytest.raises(EncodeError, match="LLMRequest"):
        codec.encode_request(req)


def test_encode_rejects_wrong_objects(codec):
    with pytest.raises(EncodeError):
        codec.encode_request(full_response())  # type: ignore[arg-type]
    with pytest.raises(EncodeError):
        codec.encode_response(object())  # type: ignore[arg-type]


def test_an_error_message_shows_a_bounded_part_of_a_value(codec):
    with pytest.raises(EncodeError) as info:
        codec.encode_request(full_request(max_tokens="x" * 10_000))
    assert len(str(info.value)) < 200


def test_response_encode_errors(codec):
    with pytest.raises(EncodeError, match="LLMResponse.*started_at"):
        codec.encode_response(full_response(started_at=1.5))
    with pytest.raises(EncodeError, match="LLMResponse.usage_estimated: None is not a bool"):
        codec.encode_response(full_response(usage_estimated=None))
    with pytest.raises(EncodeError, match="LLMResponse.finish_reason"):
        codec.encode_response(full_response(finish_reason=7))
    with pytest.raises(EncodeError, match="LLMResponse"):
        codec.encode_response(full_response(served_priority="LOW"))


def test_confluent_wire_needs_registry_and_topic(codec):
    with pytest.raises(EncodeError, match="registry"):
        codec.encode_request(full_request(), wire="confluent", topic="t")
    with pytest.raises(EncodeError, match="wire format"):
        codec.encode_request(full_request(), wire="json")  # type: ignore[arg-type]


# -- limits ---------------------------------------------------------------------------------------


def test_limits_say_which_cap_holds_where():
    limits = SerdeLimits(max_prompt_bytes=10, max_output_bytes=20, max_string_bytes=30, max_messages=4,
                         max_array_items=5)
    assert limits.cap_at("LLMRequest.prompt") == (10, "max_prompt_bytes")
    assert limits.cap_at("LLMRequest.messages[].content") == (10, "max_prompt_bytes")
    assert limits.cap_at("LLMRequest.messages[].role") == (30, "max_string_bytes")
    assert limits.cap_at("LLMResponse.output") == limits.cap_at("LLMChunk.delta") == (20, "max_output_bytes")
    assert limits.string_cap("LLMRequest", "prompt") == (10, "max_prompt_bytes")
    assert limits.string_cap("LLMResponse", "reason") == (30, "max_string_bytes")
    assert limits.items_cap_at("LLMRequest.messages") == (4, "max_messages")
    assert limits.items_cap_at("LLMRequest.stop") == (5, "max_array_items")
    assert (SerdeLimits().max_messages, SerdeLimits().max_array_items) == (256, 64)


@pytest.mark.parametrize("name", ["max_messages", "max_array_items"])
@pytest.mark.parametrize("value", [-1, 1.5, "8", None])
def test_limits_must_be_non_negative_ints(name, value):
    with pytest.raises(ValueError, match=f"SerdeLimits.{name}"):
        SerdeLimits(**{name: value})
