"""What the codec checks on a body's bytes before fastavro reads it, for every writer revision alike:
the encoding rules fastavro does not enforce, sizes against the message, and the field caps."""

from __future__ import annotations

import copy
import random
import time
import tracemalloc

import pytest

from pipeline.errors import DecodeError, EncodeError
from pipeline.models import Priority, TaskTier
from pipeline.serde import Codec, SchemaStore, SerdeLimits
from pipeline.serde.fingerprint import schema_fingerprint
from tests.unit.serde import (
    SCHEMAS_DIR,
    avro_body,
    full_request,
    history_schema,
    load_json,
    minimal_request,
    pinned_schema_dir,
    write_schema_dir,
    zigzag,
)

STORE = SchemaStore.load(SCHEMAS_DIR)
CODEC = Codec(STORE)
REVISIONS = {r.revision: r for r in STORE.revisions("llm_request")}


def message(revision: int = 4, **fields: bytes) -> bytes:
    """A request written as ``revision`` with every field at its one-byte smallest (priority
    NORMAL, task tier ASYNC), the fields named replaced by the bytes given."""
    rev = REVISIONS[revision]
    names = [f["name"] for f in rev.parsed["fields"]]
    values = {name: b"\x00" for name in names}
    values.update(priority=zigzag(2), task_tier=zigzag(1))
    unknown = set(fields) - set(names)
    assert not unknown, unknown
    values.update(fields)
    return b"\xc3\x01" + rev.fingerprint.le_bytes + b"".join(values[name] for name in names)


def refused(data: bytes, codec: Codec = CODEC) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        codec.decode_request(data)
    return info.value


every_revision = pytest.mark.parametrize("revision", [1, 2, 3, 4])


@every_revision
def test_the_smallest_message_decodes(revision):
    req = CODEC.decode_request(message(revision))
    assert req.priority is Priority.NORMAL and req.task_tier is TaskTier.ASYNC and req.metadata == {}


# -- what fastavro alone would read differently ------------------------------------------------


@every_revision
@pytest.mark.parametrize("byte", [0x02, 0x03, 0x7F, 0xFF])
def test_a_boolean_is_00_or_01(revision, byte):
    error = refused(message(revision, allow_degrade=bytes([byte])))  # fastavro: any non-zero byte is true
    assert error.reason == "invalid_field"
    assert "LLMRequest.allow_degrade" in error.detail
    assert CODEC.decode_request(message(revision, allow_degrade=b"\x01")).allow_degrade is True


@every_revision
@pytest.mark.parametrize(("field", "index"), [("priority", -1), ("priority", -5), ("task_tier", -2),
                                              ("priority", 5), ("priority", 2**20), ("task_tier", 3)])
def test_an_enum_index_is_within_its_symbols(revision, field, index):
    error = refused(message(revision, **{field: zigzag(index)}))  # fastavro reads -1 as the last symbol
    assert error.reason == "invalid_field"
    assert f"LLMRequest.{field}" in error.detail


@pytest.mark.parametrize("revision", [2, 3, 4])
@pytest.mark.parametrize("index", [-1, 2, 77])
def test_a_union_index_is_within_its_branches(revision, index):
    error = refused(message(revision, trace_id=zigzag(index) + b"\x02a"))
    assert error.reason == "invalid_field"
    assert "LLMRequest.trace_id" in error.detail


@every_revision
def test_an_int_fits_in_32_bits(revision):
    error = refused(message(revision, max_tokens=zigzag(2**40)))
    assert (error.reason, error.detail) == ("invalid_field", "LLMRequest.max_tokens: 1099511627776 is not a 32-bit int")
    # longer than needed, as fastavro reads it: zero in 5 and in 10 bytes
    for zero in (b"\x80\x80\x80\x80\x00", b"\x80" * 9 + b"\x00"):
        assert CODEC.decode_request(message(revision, max_tokens=zero)).max_tokens == 0


@every_revision
@pytest.mark.parametrize(("varint", "what"), [
    (b"\x80" * 10 + b"\x00", "longer than 10 bytes"),
    (b"\x80" * 30, "longer than 10 bytes"),
    (b"\xff" * 9 + b"\x03", "exceeds 64 bits"),
    (b"\xfe" + b"\xff" * 8 + b"\x7f", "exceeds 64 bits"),
])
def test_a_varint_is_at_most_64_bits(revision, varint, what):
    error = refused(message(revision, created_at=varint))  # fastavro wraps it around
    assert error.reason == "malformed"
    assert what in error.detail and "LLMRequest.created_at" in error.detail


def test_longs_of_every_length_round_trip():
    rng = random.Random(99)
    values = {0, 2**63 - 1, -(2**63)}
    for k in range(63):
        values.update({2**k - 1, 2**k, 2**k + 1, -(2**k), -(2**k) - 1, rng.randrange(2**k, 2**(k + 1))})
    for value in sorted(values):
        data = message(4, created_at=zigzag(value))
        assert CODEC.decode_request(data).created_at == value
        assert CODEC.encode_request(CODEC.decode_request(data)) == data


def test_valid_encodings_no_llmq_writer_produces_are_read():
    # NORMAL as a 3-byte varint; trace_id's branch 1 in 2 bytes
    req = CODEC.decode_request(message(3, priority=b"\x84\x80\x00", trace_id=b"\x82\x00\x02x"))
    assert req.priority is Priority.NORMAL and req.trace_id == "x"


# -- maps ------------------------------------------------------------------------------------------


@every_revision
@pytest.mark.parametrize(("blocks", "expected"), [
    (zigzag(1) + b"\x02a\x02b" + zigzag(1) + b"\x02c\x02d\x00", {"a": "b", "c": "d"}),  # two blocks
    (zigzag(-2) + zigzag(8) + b"\x02a\x02b\x02c\x02d\x00", {"a": "b", "c": "d"}),  # count < 0, then byte size
    (zigzag(-1) + b"\x88\x80\x00" + b"\x02a\x02b\x00", {"a": "b"}),  # a byte size in a long varint
    (zigzag(2) + b"\x02a\x02b\x02a\x02c\x00", {"a": "c"}),  # a duplicate key: the last one wins
    (b"\x80\x00", {}),  # a zero count in two bytes ends the map
])
def test_map_blocks(revision, blocks, expected):
    assert CODEC.decode_request(message(revision, metadata=blocks)).metadata == expected


@every_revision
@pytest.mark.parametrize("size", [zigzag(3), zigzag(999), zigzag(-4)])
def test_a_block_byte_size_is_its_size(revision, size):
    # fastavro skips a field unknown to its reader schema by that size, so it must be right
    error = refused(message(revision, metadata=zigzag(-1) + size + b"\x02a\x02b\x00"))
    assert error.reason == "malformed" and "LLMRequest.metadata" in error.detail


@every_revision
def test_the_map_entry_cap_counts_encoded_entries(revision):
    # 65 times the same key: one entry once built, but 65 to read
    error = refused(message(revision, metadata=zigzag(65) + b"\x02k\x02v" * 65 + b"\x00"))
    assert error.reason == "limit_exceeded" and "65 entries" in error.detail and "64" in error.detail
    # split over blocks: the running total counts
    entries = b"".join(b"\x04k%c\x02v" % (0x30 + i) for i in range(65))
    error = refused(message(revision, metadata=zigzag(40) + entries[:200] + zigzag(-25) + zigzag(125)
                            + entries[200:] + b"\x00"))
    assert error.reason == "limit_exceeded" and "65 entries" in error.detail
    # a count the rest of the message cannot hold (65 entries of 2 bytes or more, in the 23
    # entries' bytes and the fields after them) is a cut message first
    assert refused(message(revision, metadata=zigzag(65) + entries[:115])).reason == "truncated"


def _peak_bytes(data: bytes, codec: Codec = CODEC) -> tuple[DecodeError, int, float]:
    tracemalloc.start()
    start = time.perf_counter()
    try:
        error = refused(data, codec)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return error, peak, elapsed


def test_a_map_over_its_cap_is_refused_before_it_is_built():
    # 150,000 distinct entries in under 1 MB: built, they would take some 20 MB
    entries = b"".join(b"\x06%c%c%c\x00" % (i & 0x7F, (i >> 7) & 0x7F, i >> 14) for i in range(150_000))
    data = message(3, metadata=zigzag(150_000) + entries + b"\x00")
    assert len(data) < SerdeLimits().max_record_bytes
    error, peak, elapsed = _peak_bytes(data)
    assert error.reason == "limit_exceeded"
    assert peak < 1_000_000 and elapsed < 0.1, (peak, elapsed)


@pytest.mark.parametrize("metadata", [zigzag(2**62), zigzag(-(2**62)) + zigzag(2**62), zigzag(2**63 - 1)])
def test_huge_block_counts_are_refused_at_once(metadata):
    error, peak, elapsed = _peak_bytes(message(3, metadata=metadata))
    assert error.reason == "truncated" and "LLMRequest.metadata" in error.detail
    assert peak < 100_000 and elapsed < 0.1


# -- strings -----------------------------------------------------------------------------------------


@every_revision
@pytest.mark.parametrize("length", [2**62, 2**31, 100])
def test_a_string_longer_than_the_message_is_a_cut_message(revision, length):
    error, peak, elapsed = _peak_bytes(message(revision, prompt=zigzag(length) + b"abc"))
    assert error.reason == "truncated" and "LLMRequest.prompt" in error.detail
    assert peak < 100_000 and elapsed < 0.1


@every_revision
@pytest.mark.parametrize("length", [-1, -100, -(2**40)])
def test_a_negative_string_length_is_a_cut_message(revision, length):
    error = refused(message(revision, request_id=zigzag(length) + b"abc"))
    assert error.reason == "truncated" and "LLMRequest.request_id" in error.detail


@every_revision
def test_older_writers_are_capped_too(revision):
    tight = Codec(STORE, SerdeLimits(max_prompt_bytes=100, max_string_bytes=40))
    error = refused(message(revision, prompt=zigzag(101) + b"p" * 101), tight)
    assert error.reason == "limit_exceeded" and "LLMRequest.prompt: 101 bytes exceed max_prompt_bytes=100" in error.detail
    error = refused(message(revision, model=zigzag(41) + b"m" * 41), tight)
    assert "LLMRequest.model: 41 bytes exceed max_string_bytes=40" in error.detail
    assert tight.decode_request(message(revision, prompt=zigzag(100) + b"p" * 100)).prompt == "p" * 100


def test_a_cut_message_names_the_field_it_ends_in():
    data = CODEC.encode_request(full_request(prompt="ü" * 100))
    at = data.index("ü".encode() * 100)
    for cut in (at - 1, at + 1, at + 199):
        error = refused(data[:cut])
        assert error.reason == "truncated" and "LLMRequest.prompt" in error.detail


def test_encoding_keeps_to_the_same_rules():
    tight = Codec(STORE, SerdeLimits(max_string_bytes=40, max_metadata_entries=2))
    for req, needle in [(minimal_request(metadata={"a": "1", "b": "2", "c": "3"}), "LLMRequest.metadata: 3 entries"),
                        (minimal_request(metadata={"a": "v" * 41}), "LLMRequest.metadata['a']: 41 bytes"),
                        (minimal_request(max_tokens=2**31), "LLMRequest.max_tokens")]:
        with pytest.raises(EncodeError) as info:
            tight.encode_request(req)
        assert needle in str(info.value)


# -- every Avro type, through a schema that has them all ----------------------------------------------


@pytest.fixture(scope="module")
def exotic(tmp_path_factory) -> tuple[Codec, dict]:
    """A codec whose current request schema adds a field of every other Avro type."""
    current = load_json(SCHEMAS_DIR / "llm_request.avsc")
    schema = copy.deepcopy(current)
    inner = {"type": "record", "name": "Inner", "fields": [
        {"name": "a", "type": "int"}, {"name": "b", "type": ["null", {"type": "fixed", "name": "F4", "size": 4}]}]}
    schema["fields"] += [
        {"name": "x_float", "type": "float", "default": 0.0},
        {"name": "x_double", "type": "double", "default": 0.0},
        {"name": "x_bytes", "type": "bytes", "default": ""},
        {"name": "x_inner", "type": inner, "default": {"a": 0, "b": None}},
        {"name": "x_fixed", "type": "F4", "default": "\u0000\u0000\u0000\u0000"},
        {"name": "x_array", "type": {"type": "array", "items": "long"}, "default": []},
        {"name": "x_records", "type": {"type": "map", "values": "Inner"}, "default": {}},
        {"name": "x_null", "type": "null", "default": None},
    ]
    root = write_schema_dir(
        tmp_path_factory.mktemp("exotic") / "s",
        history={"llm_request": [current, schema], "llm_response": [history_schema("llm_response", 1)]},
        current={"llm_request": schema, "llm_response": history_schema("llm_response", 1)},
    )
    return Codec(SchemaStore.load(root)), schema


def _exotic_message(schema: dict, **extra) -> bytes:
    record = {**full_request().to_record(), "x_float": 1.5, "x_double": -2.25, "x_bytes": b"\x00\xff",
              "x_inner": {"a": 7, "b": b"abcd"}, "x_fixed": b"wxyz", "x_array": [1, -2, 2**40],
              "x_records": {"k": {"a": 1, "b": None}}, "x_null": None, **extra}
    return b"\xc3\x01" + schema_fingerprint(schema).le_bytes + avro_body(schema, record)


def test_every_avro_type_is_walked(exotic):
    codec, schema = exotic
    data = _exotic_message(schema)
    assert codec.decode_request(data) == full_request()
    for cut in range(len(data)):
        assert refused(data[:cut], codec).reason == "truncated", cut
    assert refused(data + b"\x00", codec).reason == "malformed"


def test_every_avro_type_is_checked(exotic):
    codec, schema = exotic
    big = codec.limits.max_string_bytes + 1
    assert refused(_exotic_message(schema, x_bytes=b"b" * big), codec).reason == "limit_exceeded"
    data = _exotic_message(schema)
    inner, array = b"\x0e\x02abcd", b"\x06\x02\x03"  # x_inner {a: 7, b: branch 1}; x_array, 3 items
    assert data.count(inner) == data.count(array) == 1
    error = refused(data.replace(inner, b"\x0e\x04abcd"), codec)  # branch 2 of 2
    assert error.reason == "invalid_field" and "LLMRequest.x_inner.b" in error.detail
    error = refused(data.replace(array, zigzag(-3) + zigzag(1) + b"\x02\x03"), codec)  # a wrong block size
    assert error.reason == "malformed" and "LLMRequest.x_array" in error.detail
    error = refused(data.replace(array, zigzag(2**40) + b"\x02\x03"), codec)
    assert error.reason == "truncated" and "LLMRequest.x_array" in error.detail


# -- revision 4's arrays and nested record ------------------------------------------------------------


def _chat(role: bytes = b"user", content: bytes = b"hi", name: bytes = b"\x00") -> bytes:
    """One ChatMessage as bytes: role, content, the name's union branch (and value)."""
    return zigzag(len(role)) + role + zigzag(len(content)) + content + name


@pytest.mark.parametrize(("blocks", "expected"), [
    (zigzag(1) + _chat() + zigzag(1) + _chat(b"assistant", b"yo") + b"\x00", 2),  # two blocks
    (zigzag(-2) + zigzag(2 * len(_chat())) + _chat() * 2 + b"\x00", 2),  # count < 0, then byte size
    (b"\x80\x00", 0),  # a zero count in two bytes ends the array
])
def test_message_blocks(blocks, expected):
    assert len(CODEC.decode_request(message(messages=blocks)).messages) == expected


@pytest.mark.parametrize("size", [zigzag(3), zigzag(999), zigzag(-4)])
def test_a_message_block_byte_size_is_its_size(size, tmp_path):
    data = message(messages=zigzag(-1) + size + _chat() + b"\x00")
    error = refused(data)
    assert error.reason == "malformed" and "LLMRequest.messages" in error.detail
    # A reader of revision 3 skips the whole field by that size: it checks it all the same.
    older = Codec(SchemaStore.load(pinned_schema_dir(tmp_path / "s", llm_request=3), allow_older_current=True))
    assert refused(data, older).reason == "malformed"
    right = message(messages=zigzag(-1) + zigzag(len(_chat())) + _chat() + b"\x00", prompt=b"\x02p")
    assert older.decode_request(right).prompt == "p"


@pytest.mark.parametrize("index", [-1, 2, 77])
def test_a_message_name_union_index_is_within_its_branches(index):
    error = refused(message(messages=zigzag(1) + _chat(name=zigzag(index) + b"\x02n") + b"\x00"))
    assert error.reason == "invalid_field" and "LLMRequest.messages[].name" in error.detail


def test_the_array_caps_count_encoded_items_across_blocks():
    one = _chat()
    error = refused(message(messages=(zigzag(1) + one) * 257 + b"\x00"))
    assert error.reason == "limit_exceeded" and "257 items exceed max_messages=256" in error.detail
    error = refused(message(stop=zigzag(40) + b"\x02s" * 40 + zigzag(25) + b"\x02s" * 25 + b"\x00"))
    assert error.reason == "limit_exceeded" and "LLMRequest.stop: 65 items exceed max_array_items=64" in error.detail
    assert len(CODEC.decode_request(message(stop=zigzag(64) + b"\x02s" * 64 + b"\x00")).stop) == 64


def test_an_array_over_its_cap_is_refused_before_it_is_built():
    # 500,000 empty stop strings in under 1 MB: a list fastavro would build in full
    data = message(stop=zigzag(500_000) + b"\x00" * 500_000 + b"\x00")
    assert len(data) < SerdeLimits().max_record_bytes
    error, peak, elapsed = _peak_bytes(data)
    assert error.reason == "limit_exceeded" and "LLMRequest.stop" in error.detail
    assert peak < 1_000_000 and elapsed < 0.1, (peak, elapsed)


@pytest.mark.parametrize("field", ["messages", "stop"])
@pytest.mark.parametrize("count", [2**62, -(2**62), 2**63 - 1])
def test_huge_array_counts_are_refused_at_once(field, count):
    error, peak, elapsed = _peak_bytes(message(**{field: zigzag(count) + (zigzag(2**62) if count < 0 else b"")}))
    assert error.reason == "truncated" and f"LLMRequest.{field}" in error.detail
    assert peak < 100_000 and elapsed < 0.1


def test_a_message_content_has_the_prompt_cap_and_its_role_the_string_cap():
    tight = Codec(STORE, SerdeLimits(max_prompt_bytes=100, max_string_bytes=40))
    error = refused(message(messages=zigzag(1) + _chat(content=b"c" * 101) + b"\x00"), tight)
    assert error.reason == "limit_exceeded"
    assert "LLMRequest.messages[].content: 101 bytes exceed max_prompt_bytes=100" in error.detail
    error = refused(message(messages=zigzag(1) + _chat(role=b"r" * 41) + b"\x00"), tight)
    assert "LLMRequest.messages[].role: 41 bytes exceed max_string_bytes=40" in error.detail
    ok = tight.decode_request(message(messages=zigzag(1) + _chat(content=b"c" * 100) + b"\x00"))
    assert ok.messages == [{"role": "user", "content": "c" * 100}]


def test_a_cut_message_names_the_nested_field_it_ends_in():
    data = message(messages=zigzag(1) + _chat(content=b"c" * 30) + b"\x00")
    at = data.index(b"c" * 30)
    error = refused(data[:at + 10])
    assert error.reason == "truncated" and "LLMRequest.messages[].content" in error.detail


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_double_needs_its_eight_bytes(field):
    double = b"\x02" + b"\xab" * 8
    data = message(**{field: double})
    assert CODEC.decode_request(data) is not None
    at = data.index(double)
    for cut in range(at + 1, at + 9):
        error = refused(data[:cut])
        assert error.reason == "truncated" and f"LLMRequest.{field}" in error.detail


def test_reply_partition_is_a_32_bit_int():
    error = refused(message(reply_partition=b"\x02" + zigzag(2**31)))
    assert error.reason == "invalid_field" and "LLMRequest.reply_partition" in error.detail
    assert CODEC.decode_request(message(reply_partition=b"\x02" + zigzag(2**31 - 1))).reply_partition == 2**31 - 1
