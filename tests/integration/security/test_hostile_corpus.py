"""A corpus of malformed and hostile request messages, through a real broker and one worker.

Every case is a named message with the outcome the worker actually gives it (read off
``Worker.handle``, the codec and ``validate_request``):

* ``Dlq(reason)``: a dead letter with the original key and bytes, whose
  ``llmq.dlq.reason`` header is ``reason``;
* ``Answer(status, reason_prefix)``: a response with that status and reason.

All of them are produced with a plain confluent_kafka ``Producer`` onto the request
topics, each on an explicit partition, and every partition used ends with a valid
*sentinel* request: the sentinels completing proves no hostile message stalled its
partition. One worker then runs the lot; afterwards its group's committed offsets must be
at the end of every request partition, and its thread must not have raised.

The worker runs with small serde limits (``settings.serde``) so that the "too large"
cases stay cheap; the worker builds its codec from those settings.

Cases where the code crashes or answers misleadingly are marked ``xfail(strict=True)``
with the reason; they are findings, not expectations.
"""

from __future__ import annotations

import struct
import time
import tracemalloc
import uuid
from dataclasses import dataclass, field
from typing import Callable

import pytest
from confluent_kafka import Producer

from pipeline.dlq import header_dict
from pipeline.errors import LimitExceeded
from pipeline.models import Priority, Request, Response, Status, now_ms
from pipeline.serde import Codec, SchemaStore, SerdeLimits
from pipeline.testing import avro_string, zigzag
from pipeline.topics import create_pipeline_topics
from tests.integration.harness import committed_offsets, end_offsets, make_settings, read_topic, running_worker

# -- limits the worker runs with --------------------------------------------------------------

LIMITS = SerdeLimits(max_record_bytes=8192, max_prompt_bytes=2048, max_metadata_entries=8,
                     max_string_bytes=512, max_output_bytes=8192)

# -- a raw Avro writer: it writes what no well-behaved encoder would ---------------------------

_STORE = SchemaStore.load()
_REV = {r.revision: r for r in _STORE.revisions("llm_request")}
CURRENT = _STORE.current_revision("llm_request")
HEADER = b"\xc3\x01" + CURRENT.fingerprint.le_bytes
HEADERS = {n: b"\xc3\x01" + rev.fingerprint.le_bytes for n, rev in _REV.items()}
HEADER_V1 = HEADERS[1]

# Field order and kinds of the request schema: the current revision (4), revision 3 and revision 1.
# Older writers are resolved to the current revision by fastavro, after the same checks of their
# bytes (see the v1_writer_* and v3_writer cases).
FIELDS_V2 = (("request_id", "string"), ("tenant_id", "string"), ("priority", "enum"), ("prompt", "string"),
             ("model", "string"), ("max_tokens", "int"), ("created_at", "long"), ("timeout_ms", "long"),
             ("user_tier", "string"), ("task_tier", "enum"), ("allow_degrade", "boolean"),
             ("notify_queued", "boolean"), ("trace_id", "union"), ("metadata", "map"))
FIELDS_V3 = FIELDS_V2 + (("admitted_at", "union"), ("effective_priority", "union"), ("degraded_from", "union"))
FIELDS_V4 = FIELDS_V3 + (("messages", "messages"), ("temperature", "double_union"), ("top_p", "double_union"),
                         ("stop", "strings"), ("user", "union"), ("stream", "boolean"), ("reply_to", "union"),
                         ("reply_partition", "int_union"))
FIELDS_V1 = tuple(f for f in FIELDS_V2 if f[0] not in ("notify_queued", "trace_id"))
FIELDS = {1: FIELDS_V1, 3: FIELDS_V3, 4: FIELDS_V4}

PRIORITY_INDEX = {p: i for i, p in enumerate(Priority)}
DAY_MS = 24 * 3600 * 1000


class Raw(bytes):
    """Bytes written verbatim in place of a field's encoding."""


zz = zigzag


def _field(kind: str, value) -> bytes:
    if isinstance(value, Raw):
        return bytes(value)
    if kind == "string":
        return avro_string(value)
    if kind in ("int", "long"):
        return zz(value)
    if kind == "enum":
        return zz(PRIORITY_INDEX[value] if isinstance(value, Priority) else value)
    if kind == "boolean":
        return bytes((int(value),))
    if kind == "union":
        return b"\x00" if value is None else b"\x02" + avro_string(value)
    if kind == "map":
        if not value:
            return b"\x00"
        return zz(len(value)) + b"".join(avro_string(k) + avro_string(v) for k, v in value.items()) + b"\x00"
    if kind == "double_union":
        return b"\x00" if value is None else b"\x02" + struct.pack("<d", value)
    if kind == "int_union":
        return b"\x00" if value is None else b"\x02" + zz(value)
    if kind == "strings":
        return (zz(len(value)) + b"".join(avro_string(v) for v in value) if value else b"") + b"\x00"
    if kind == "messages":
        items = b"".join(avro_string(m["role"]) + avro_string(m["content"]) + _field("union", m.get("name"))
                         for m in value)
        return (zz(len(value)) + items if value else b"") + b"\x00"
    raise AssertionError(kind)


def valid_fields(**over) -> dict:
    """Field values of a valid request (the sentinel's kind), overridden by ``over``."""
    values = dict(request_id=str(uuid.uuid4()), tenant_id="tenant-corpus", priority=Priority.NORMAL,
                  prompt="hello there", model="sim-small", max_tokens=16, created_at=now_ms(),
                  timeout_ms=DAY_MS, user_tier="standard", task_tier=1, allow_degrade=False,
                  notify_queued=False, trace_id=None, metadata={}, admitted_at=None, effective_priority=None,
                  degraded_from=None, messages=[], temperature=None, top_p=None, stop=[], user=None, stream=False,
                  reply_to=None, reply_partition=None)
    values.update(over)
    return values


def body(values: dict, revision: int = 4) -> bytes:
    return b"".join(_field(kind, values[name]) for name, kind in FIELDS[revision])


def raw_request(revision: int = 4, **over) -> tuple[str, bytes]:
    """(request_id, single-object message) of a request with the fields ``over`` overridden."""
    values = valid_fields(**over)
    return values["request_id"], HEADERS[revision] + body(values, revision)


def huge_count_message() -> bytes:
    """33 bytes: every field empty/zero, then a metadata map claiming 2**62 entries."""
    return HEADER + b"\x00" * 13 + zz(1 << 62)


# -- the corpus --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dlq:
    reason: str


@dataclass(frozen=True)
class Answer:
    status: Status
    reason_prefix: str | None = None
    check: Callable[[Response], None] | None = None


@dataclass
class Case:
    name: str
    value: bytes | None
    expect: Dlq | Answer
    request_id: str | None = None  # to find the response (Answer cases)
    band: Priority = Priority.NORMAL  # topic
    partition: int = 0
    key: bytes | None = b"corpus"
    headers: list | None = None
    xfail: str | None = None
    extra: Callable[[object], None] | None = None  # more checks on the dead letter (Dlq cases)


REQ = Status.REJECTED
INVALID = "invalid_request: "
MAX_TOKENS_GT0 = INVALID + "max_tokens must be > 0"
TIMEOUT_GT0 = INVALID + "timeout_ms must be > 0"
CONTROL = INVALID + "tenant_id contains control characters"
NOT_UUID = INVALID + "request_id must be a UUID"

def _rejected(prefix: str) -> Answer:
    return Answer(REQ, prefix)


def _request_case(name: str, expect: Answer, revision: int = 4, **over) -> Case:
    rid, value = raw_request(revision, **over)
    return Case(name, value, expect, request_id=rid)


def _body_wins(tenant: str, priority: Priority) -> Callable[[Response], None]:
    def check(resp: Response) -> None:
        assert resp.tenant_id == tenant
        assert resp.requested_priority is priority and resp.served_priority is priority

    return check


def _model_is(model: str) -> Callable[[Response], None]:
    def check(resp: Response) -> None:
        assert resp.model == model

    return check


def _tenant_is(tenant: str) -> Callable[[Response], None]:
    def check(resp: Response) -> None:
        assert resp.tenant_id == tenant

    return check


def build_corpus() -> list[Case]:
    cases: list[Case] = []
    add = cases.append
    good = raw_request()[1]
    good_body = good[10:]
    default_codec = Codec.default()  # default (large) limits: encodes what the worker's limits refuse

    # -- framing -------------------------------------------------------------------------------
    add(Case("wrong_magic_c302", b"\xc3\x02" + good[2:], Dlq("bad_magic")))
    add(Case("wrong_magic_json", b'{"request_id": "x", "tenant_id": "t", "prompt": "p"}', Dlq("bad_magic")))
    add(Case("lone_c3_byte", b"\xc3", Dlq("truncated")))
    add(Case("empty_value", b"", Dlq("empty")))  # zero bytes and a tombstone get the same reason
    add(Case("tombstone", None, Dlq("empty")))
    add(Case("header_only_2_bytes", b"\xc3\x01", Dlq("truncated")))
    add(Case("header_cut_in_fingerprint", HEADER[:7], Dlq("truncated")))
    add(Case("header_only_10_bytes", HEADER, Dlq("truncated")))
    add(Case("unknown_fingerprint", b"\xc3\x01" + bytes.fromhex("0123456789abcdef") + good_body,
             Dlq("unknown_fingerprint")))
    resp = Response(request_id=str(uuid.uuid4()), tenant_id="tenant-corpus", status=Status.COMPLETED,
                    requested_priority=Priority.NORMAL, created_at=now_ms(), finished_at=now_ms())
    add(Case("response_record_on_request_topic", default_codec.encode_response(resp), Dlq("unknown_fingerprint")))
    add(Case("confluent_unknown_schema_id", b"\x00" + (42).to_bytes(4, "big") + good_body, Dlq("unknown_schema_id")))
    add(Case("confluent_header_only", b"\x00\x00\x00\x00\x01", Dlq("unknown_schema_id")))
    add(Case("confluent_header_cut", b"\x00\x00\x01", Dlq("truncated")))

    # -- truncation and trailing bytes ---------------------------------------------------------
    for name, cut in (("truncated_after_1_body_byte", 11), ("truncated_inside_request_id", 30),
                      ("truncated_half", len(good) // 2), ("truncated_last_byte", len(good) - 1)):
        add(Case(name, good[:cut], Dlq("truncated")))
    add(Case("trailing_garbage", good + b"\x00garbage", Dlq("malformed")))

    # -- size caps (worker limits: record 8192, prompt 2048, strings 512, metadata 8) ----------
    add(Case("over_max_record_bytes", good + b"\x00" * LIMITS.max_record_bytes, Dlq("too_large")))
    add(Case("over_max_record_bytes_garbage", b"\xff" * (LIMITS.max_record_bytes + 1), Dlq("too_large")))
    # Over a string cap yet readable: answered, naming the limit. Not when what the answer carries
    # (the tenant here) is over its cap: nobody to answer.
    big = Request.new("tenant-corpus", "p" * 3000)
    add(Case("prompt_over_cap", default_codec.encode_request(big),
             _rejected(INVALID + "prompt is 3000 bytes, over the 2048-byte limit (max_prompt_bytes)"),
             request_id=big.request_id))
    add(Case("tenant_over_string_cap", raw_request(tenant_id="t" * 600)[1], Dlq("limit_exceeded")))
    add(Case("metadata_too_many_entries", raw_request(metadata={f"k{i}": "v" for i in range(20)})[1],
             Dlq("limit_exceeded")))
    add(_request_case("metadata_value_over_cap",
                      _rejected(INVALID + "metadata value is 600 bytes, over the 512-byte limit (max_string_bytes)"),
                      metadata={"k": "v" * 600}))
    add(Case("huge_map_count_33_bytes", huge_count_message(), Dlq("truncated")))
    add(Case("huge_map_count_v1_writer", HEADER_V1 + b"\x00" * 11 + zz(1 << 62), Dlq("truncated")))
    add(Case("huge_negative_block_count", HEADER + b"\x00" * 13 + zz(-(1 << 62)) + zz(1 << 62),
             Dlq("truncated")))
    add(Case("huge_string_length_20_bytes", HEADER + zz(1 << 62), Dlq("truncated")))
    add(Case("negative_string_length", HEADER + zz(-3) + b"abc", Dlq("truncated")))

    # -- values the schema does not allow ------------------------------------------------------
    add(Case("priority_enum_index_5", raw_request(priority=5)[1], Dlq("invalid_field")))
    add(Case("priority_enum_index_negative", raw_request(priority=-1)[1], Dlq("invalid_field")))
    add(Case("task_tier_enum_index_3", raw_request(task_tier=3)[1], Dlq("invalid_field")))
    add(Case("trace_id_union_index_2", raw_request(trace_id=Raw(b"\x04\x02x"))[1], Dlq("invalid_field")))
    add(Case("boolean_byte_0x02", raw_request(allow_degrade=2)[1], Dlq("invalid_field")))
    add(Case("max_tokens_beyond_int32", raw_request(max_tokens=1 << 40)[1], Dlq("invalid_field")))
    add(Case("overlong_varint_max_tokens", raw_request(max_tokens=Raw(b"\x80" * 10 + b"\x00"))[1],
             Dlq("malformed")))
    add(Case("invalid_utf8_tenant", raw_request(tenant_id=b"ten\xffant")[1], Dlq("malformed")))
    add(Case("utf8_encoded_surrogate_in_prompt", raw_request(prompt=b"a\xed\xa0\x80b")[1], Dlq("malformed")))
    add(Case("invalid_utf8_metadata_key", raw_request(metadata=Raw(b"\x02\x02\xc3\x02v\x00"))[1],
             Dlq("malformed")))

    # -- garbage carrying hostile keys and headers ---------------------------------------------
    add(Case("garbage_with_spoofed_dlq_headers", b"not avro at all", Dlq("bad_magic"),
             headers=[("llmq.dlq.reason", b"spoofed"), ("llmq.dlq.source.topic", b"elsewhere"),
                      ("llmq.dlq.source.offset", b"999999")]))
    add(Case("garbage_with_huge_key_and_many_headers", b"\xde\xad\xbe\xef", Dlq("bad_magic"),
             key=b"K" * 100_000, headers=[(f"h{i}", b"v" * 10) for i in range(500)] + [("none", None)]))

    # -- decodable, rejected by validation ----------------------------------------------------
    add(_request_case("negative_max_tokens", _rejected(MAX_TOKENS_GT0), max_tokens=-5))
    add(_request_case("zero_max_tokens", _rejected(MAX_TOKENS_GT0), max_tokens=0))
    add(_request_case("int32_min_max_tokens", _rejected(MAX_TOKENS_GT0), max_tokens=-(1 << 31)))
    add(_request_case("max_tokens_above_limit", _rejected(INVALID + "max_tokens must be <="), max_tokens=1_000_001))
    add(_request_case("zero_timeout_ms", _rejected(TIMEOUT_GT0), timeout_ms=0))
    add(_request_case("negative_timeout_ms", _rejected(TIMEOUT_GT0), timeout_ms=-(1 << 63)))
    add(_request_case("empty_tenant", _rejected(INVALID + "tenant_id is empty"), tenant_id=""))
    add(_request_case("blank_tenant", _rejected(INVALID + "tenant_id is empty"), tenant_id=" \t "))
    add(_request_case("tenant_with_nul", _rejected(CONTROL), tenant_id="ten\x00ant"))
    add(_request_case("tenant_with_newline", _rejected(CONTROL), tenant_id="tenant\nX-Admin: 1"))
    add(_request_case("tenant_with_escape", _rejected(CONTROL), tenant_id="tenant\x1b[31m"))
    add(_request_case("tenant_with_c1_nel", _rejected(CONTROL), tenant_id="tenant\x85"))
    add(_request_case("tenant_too_long", _rejected(INVALID + "tenant_id is longer than 256"), tenant_id="t" * 300))
    add(_request_case("request_id_path", _rejected(NOT_UUID), request_id="../../etc/passwd"))
    add(_request_case("request_id_uuid_plus_newline", _rejected(NOT_UUID), request_id=str(uuid.uuid4()) + "\n"))
    add(_request_case("request_id_empty", _rejected(NOT_UUID), request_id=""))
    add(_request_case("empty_prompt", _rejected(INVALID + "prompt is empty"), prompt=""))
    # No model named: it runs on the default (the simulated model's first name).
    add(_request_case("empty_model", Answer(Status.COMPLETED, check=_model_is("sim-small")), model=""))

    # -- decodable and valid, but old -----------------------------------------------------------
    add(_request_case("replayed_old_request", Answer(Status.EXPIRED, "deadline_passed"),
                      created_at=now_ms() - 30 * DAY_MS, timeout_ms=60_000))
    add(_request_case("created_at_epoch_zero", Answer(Status.EXPIRED, "deadline_passed"), created_at=0))

    # -- processed by what the body says, whatever else the message says ------------------------
    rid, value = raw_request(tenant_id="tenant-real", priority=Priority.LOW)
    add(Case("spoofed_headers", value,
             Answer(Status.COMPLETED, check=_body_wins("tenant-real", Priority.LOW)), request_id=rid,
             key=b"admin",
             headers=[("tenant_id", b"admin"), ("priority", b"CRITICAL"), ("llmq.dlq.reason", b"none"),
                      ("x-llmq-tenant", b"admin"), ("status", b"COMPLETED")]))
    rid, value = raw_request(tenant_id="tenant-banded", priority=Priority.CRITICAL)
    add(Case("wrong_band_topic", value, Answer(Status.COMPLETED, check=_body_wins("tenant-banded", Priority.CRITICAL)),
             request_id=rid, band=Priority.LOW))
    rid, value = raw_request(tenant_id="tenant-keyed")
    add(Case("valid_with_huge_key_and_many_headers", value, Answer(Status.COMPLETED), request_id=rid,
             key=b"K" * 100_000, headers=[(f"h{i}", b"v" * 10) for i in range(500)] + [("none", None)]))
    rid, value = raw_request(tenant_id="tenant-dup")
    add(Case("duplicate_request_id_first", value, Answer(Status.COMPLETED), request_id=rid))
    # A copy is given the first answer again (see test_a_copy_is_given_the_first_answer_again).
    add(Case("duplicate_request_id_second", value, Answer(Status.COMPLETED), request_id=rid))
    # Ids are deduplicated per worker, not per tenant: another tenant's request with an id
    # already seen is rejected (and its REJECTED answer carries its own tenant, not the first
    # answer).
    rid, value = raw_request(tenant_id="tenant-first")
    add(Case("same_request_id_other_tenant_first", value, Answer(Status.COMPLETED), request_id=rid))
    add(_request_case("same_request_id_other_tenant_second", Answer(REQ, "duplicate_request_id",
                                                                    check=_tenant_is("tenant-second")),
                      request_id=rid, tenant_id="tenant-second"))

    def v1_defaults(resp: Response) -> None:
        assert resp.metadata == {}  # trace_id defaulted to null

    add(_request_case("v1_writer", Answer(Status.COMPLETED, check=v1_defaults), revision=1))
    # fastavro alone would read a negative enum index from the end of the list and any non-zero
    # boolean byte as true; the codec checks every writer revision's bytes alike before it reads.
    add(Case("v1_writer_negative_priority_index", raw_request(1, priority=-1)[1], Dlq("invalid_field")))
    add(Case("v1_writer_boolean_byte_0x02", raw_request(1, allow_degrade=2)[1], Dlq("invalid_field")))

    # Valid encodings no llmq encoder writes.
    add(_request_case("metadata_negative_block_count", Answer(Status.COMPLETED),
                      metadata=Raw(zz(-1) + zz(4) + avro_string("k") + avro_string("v") + b"\x00")))
    add(_request_case("metadata_two_blocks_duplicate_keys", Answer(Status.COMPLETED),
                      metadata=Raw(zz(1) + avro_string("k") + avro_string("1")
                                   + zz(1) + avro_string("k") + avro_string("2") + b"\x00")))
    add(_request_case("uppercase_uuid", Answer(Status.COMPLETED), request_id=str(uuid.uuid4()).upper()))

    # Found by this corpus and since refused: terminal escapes echoed back in trace ids, bidi
    # overrides in tenant ids, and requests dated so far ahead that they never expire.
    add(_request_case("trace_id_with_control_chars", _rejected(INVALID + "trace_id must be"),
                      trace_id="trace\x1b[2J\n"))
    add(_request_case("tenant_with_bidi_override", _rejected(CONTROL), tenant_id="tenant\u202egnp.exe"))
    add(_request_case("created_at_far_future", _rejected(INVALID + "created_at is"),
                      created_at=(1 << 63) - 1, timeout_ms=(1 << 63) - 1))

    # -- revision 4: the OpenAI request shape ---------------------------------------------------
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there", "name": "al"}]

    def chat_kept(resp: Response) -> None:
        assert resp.output and resp.tenant_id == "tenant-corpus"

    add(_request_case("v4_chat_request", Answer(Status.COMPLETED, check=chat_kept), messages=chat,
                      prompt="system: Be brief.\nuser: hello there", temperature=0.5, top_p=0.9, stop=["\n\n"],
                      user="end-user-1", reply_partition=0))
    add(_request_case("v3_writer", Answer(Status.COMPLETED), revision=3))
    one = {"role": "user", "content": "x"}
    add(Case("messages_over_count_cap", raw_request(messages=[one] * 257)[1], Dlq("limit_exceeded")))
    add(Case("stop_over_array_cap", raw_request(stop=["s"] * 65)[1], Dlq("limit_exceeded")))
    add(_request_case("message_content_over_prompt_cap",
                      _rejected(INVALID + "messages[].content is 2049 bytes, over the 2048-byte limit"),
                      messages=[{"role": "user", "content": "c" * (LIMITS.max_prompt_bytes + 1)}]))
    add(_request_case("message_role_over_string_cap",
                      _rejected(INVALID + "messages[].role is 513 bytes, over the 512-byte limit"),
                      messages=[{"role": "r" * (LIMITS.max_string_bytes + 1), "content": "x"}]))
    add(Case("messages_huge_count", raw_request(messages=Raw(zz(1 << 62)))[1], Dlq("truncated")))
    add(Case("stop_huge_negative_count", raw_request(stop=Raw(zz(-(1 << 62)) + zz(1 << 62)))[1], Dlq("truncated")))
    add(Case("messages_wrong_block_size",
             raw_request(messages=Raw(zz(-1) + zz(99) + avro_string("user") + avro_string("x") + b"\x00\x00"))[1],
             Dlq("malformed")))
    add(Case("message_name_union_index_2",
             raw_request(messages=Raw(zz(1) + avro_string("user") + avro_string("x") + b"\x04\x02n\x00"))[1],
             Dlq("invalid_field")))
    add(Case("temperature_union_index_2", raw_request(temperature=Raw(b"\x04" + bytes(8)))[1], Dlq("invalid_field")))
    add(Case("reply_partition_beyond_int32", raw_request(reply_partition=1 << 31)[1], Dlq("invalid_field")))
    add(Case("stream_boolean_byte_0x02", raw_request(stream=2)[1], Dlq("invalid_field")))
    add(Case("invalid_utf8_message_content",
             raw_request(messages=Raw(zz(1) + avro_string("user") + b"\x04\xff\xfe" + b"\x00\x00"))[1],
             Dlq("malformed")))
    add(_request_case("unknown_chat_role", _rejected(INVALID + "messages[0].role must be one of"),
                      messages=[{"role": "root", "content": "x"}]))
    add(_request_case("role_with_escape_codes", _rejected(INVALID + "messages[0].role must be one of"),
                      messages=[{"role": "\x1b]0;owned\x07", "content": "x"}]))
    add(_request_case("message_name_with_newline", _rejected(INVALID + "messages[0].name must be"),
                      messages=[{"role": "user", "content": "x", "name": "a\nX-Admin: 1"}]))
    add(_request_case("temperature_above_2", _rejected(INVALID + "temperature must be"), temperature=2.5))
    add(_request_case("temperature_nan", _rejected(INVALID + "temperature must be"), temperature=float("nan")))
    add(_request_case("top_p_zero", _rejected(INVALID + "top_p must be"), top_p=0.0))
    add(_request_case("five_stop_sequences", _rejected(INVALID + "stop has 5 sequences"), stop=list("abcde")))
    add(_request_case("empty_stop_sequence", _rejected(INVALID + "stop[0] must be"), stop=[""]))
    add(_request_case("user_with_control_chars", _rejected(INVALID + "user must be"), user="u\x00"))
    add(_request_case("negative_reply_partition", _rejected(INVALID + "reply_partition must be >= 0"),
                      reply_partition=-1))
    add(_request_case("reply_to_not_a_topic_name", _rejected(INVALID + "reply_to must be a Kafka topic name"),
                      reply_to="../../etc/passwd"))
    return cases


CASES = build_corpus()


def test_corpus_is_large_distinct_and_named_uniquely():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    values = [c.value for c in CASES if c.name != "duplicate_request_id_second"]
    assert len(values) == len(set(values)) >= 30


def test_the_raw_writer_agrees_with_the_codec():
    """The corpus's hand-written encoder writes exactly what the codec writes (no schema drift)."""
    openai = dict(messages=[{"role": "user", "content": "hi", "name": "al"}, {"role": "system", "content": "s"}],
                  temperature=0.25, top_p=1.0, stop=["a", "bc"], user="u", stream=True, reply_to="llm.r",
                  reply_partition=300)
    for extra in ({}, openai):
        values = valid_fields(trace_id="abc", metadata={"k": "v"}, notify_queued=True, **extra)
        req = Request(request_id=values["request_id"], tenant_id=values["tenant_id"], priority=Priority.NORMAL,
                      prompt=values["prompt"], model=values["model"], max_tokens=16, created_at=values["created_at"],
                      timeout_ms=values["timeout_ms"], trace_id="abc", metadata={"k": "v"}, notify_queued=True,
                      **extra)
        assert HEADER + body(values) == Codec.default().encode_request(req)
    assert [f["name"] for f in CURRENT.parsed["fields"]] == [name for name, _ in FIELDS_V4]
    for revision, fields in FIELDS.items():
        assert [f["name"] for f in _REV[revision].parsed["fields"]] == [name for name, _ in fields]


def test_the_huge_count_message_decodes_fast_in_little_memory():
    codec = Codec(SchemaStore.load(), LIMITS)
    for data in (huge_count_message(), HEADER_V1 + b"\x00" * 11 + zz(1 << 62), HEADER + zz(1 << 62)):
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            with pytest.raises(Exception) as info:
                codec.decode_request(data)
            elapsed = time.perf_counter() - t0
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert getattr(info.value, "reason", None) == "truncated", info.value
        assert elapsed < 0.1, f"{len(data)}-byte message took {elapsed:.3f}s"
        assert peak < 1_000_000, f"{len(data)}-byte message peaked at {peak} bytes"


# -- running the corpus -------------------------------------------------------------------------


@dataclass
class Run:
    settings: object
    offsets: dict = field(default_factory=dict)  # case name -> (topic, partition, offset)
    sentinels: dict = field(default_factory=dict)  # (topic, partition) -> request_id
    responses: dict = field(default_factory=dict)  # request_id -> [Response, ...] in topic order
    letters: dict = field(default_factory=dict)  # (topic, partition, offset) -> dead letter message
    stats: object = None
    codec_limits: object = None
    fatal: object = None
    errors: list = field(default_factory=list)
    processing_s: float = 0.0
    committed: dict = field(default_factory=dict)
    ends: dict = field(default_factory=dict)


def _first(headers, key: str) -> str | None:
    for k, v in headers or ():
        if k == key:
            return (v or b"").decode()
    return None


@pytest.fixture(scope="module")
def run(bootstrap) -> Run:
    settings = make_settings(bootstrap)
    for name in ("max_record_bytes", "max_prompt_bytes", "max_metadata_entries", "max_string_bytes",
                 "max_output_bytes"):
        setattr(settings.serde, name, getattr(LIMITS, name))
    create_pipeline_topics(settings)
    result = Run(settings)
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    codec = Codec.default()

    def record(name):
        def on_delivery(err, msg):
            assert err is None, f"{name}: {err}"
            result.offsets[name] = (msg.topic(), msg.partition(), msg.offset())
        return on_delivery

    used = []
    for case in CASES:
        topic = settings.topics.request_topic(case.band)
        if (topic, case.partition) not in used:
            used.append((topic, case.partition))
        producer.produce(topic, case.value, case.key, partition=case.partition, headers=case.headers,
                         on_delivery=record(case.name))
    for topic, partition in used:  # last on every partition used
        sentinel = Request.new("tenant-sentinel", f"sentinel of {topic}[{partition}]")
        result.sentinels[(topic, partition)] = sentinel.request_id
        producer.produce(topic, codec.encode_request(sentinel), b"tenant-sentinel", partition=partition)
    assert producer.flush(30) == 0
    assert len(result.offsets) == len(CASES)

    expected_responses = sum(isinstance(c.expect, Answer) for c in CASES) + len(result.sentinels)
    expected_letters = sum(isinstance(c.expect, Dlq) for c in CASES)
    bs = settings.kafka.bootstrap
    try:
        with running_worker(settings) as worker:
            result.codec_limits = worker.codec.limits
            try:
                read_topic(bs, settings.topics.responses, timeout=60,
                           until=lambda msgs: len(msgs) >= expected_responses)
                read_topic(bs, settings.topics.dlq, timeout=30, until=lambda msgs: len(msgs) >= expected_letters)
            finally:
                result.stats = worker.stats
                result.fatal = worker.session.fatal
                result.processing_s = worker.stats.last_delivered_at - worker.stats.first_consumed_at
    except BaseException as exc:  # noqa: BLE001 - reported by the tests below
        result.errors.append(exc)

    for msg in read_topic(bs, settings.topics.responses, timeout=30):
        resp = codec.decode_response(msg.value())
        result.responses.setdefault(resp.request_id, []).append(resp)
    for msg in read_topic(bs, settings.topics.dlq, timeout=30):
        h = msg.headers()
        where = (_first(h, "llmq.dlq.source.topic"), int(_first(h, "llmq.dlq.source.partition")),
                 int(_first(h, "llmq.dlq.source.offset")))
        assert where not in result.letters, f"two dead letters for {where}"
        result.letters[where] = msg
    topics = settings.topics.request_topics
    result.committed = committed_offsets(bs, settings.worker.group_id, topics)
    result.ends = end_offsets(bs, topics)
    return result


def _tenant(case: Case) -> str:
    try:
        return Codec(SchemaStore.load(), LIMITS).decode_request(case.value).tenant_id
    except LimitExceeded as exc:  # over a cap, answered all the same
        return exc.request.tenant_id


def _answers(run: Run, case: Case) -> tuple[list[Response], int]:
    """The responses to ``case``'s request id and tenant, and which of them is this case's.

    Responses are keyed by tenant, so one tenant's answers to one id are in order.
    """
    tenant = _tenant(case)
    same = [c for c in CASES if c.request_id == case.request_id and _tenant(c) == tenant]
    return [r for r in run.responses.get(case.request_id, []) if r.tenant_id == tenant], same.index(case)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)]
                                               if c.xfail else []) for c in CASES])
def test_case_outcome(run: Run, case: Case):
    where = run.offsets[case.name]
    letter = run.letters.get(where)
    if isinstance(case.expect, Dlq):
        assert letter is not None, f"no dead letter for {case.name} at {where}"
        assert letter.value() == case.value, "the dead letter must carry the original bytes"
        assert letter.key() == case.key
        own = letter.headers()
        assert _first(own, "llmq.dlq.reason") == case.expect.reason, _first(own, "llmq.dlq.error")
        assert _first(own, "llmq.dlq.stage") == "worker"
        assert _first(own, "llmq.dlq.error")
        for k, v in case.headers or ():
            # The producer's headers are kept; those in llmq's namespace renamed, not trusted.
            kept = f"original.{k}" if k.startswith("llmq.") else k
            assert (kept, v if v is not None else b"") in own
        # What a tool reading the headers as a dict (or by Kafka's lastHeader) sees.
        seen = header_dict(own)
        assert seen["llmq.dlq.reason"] == case.expect.reason
        assert (seen["llmq.dlq.source.topic"], int(seen["llmq.dlq.source.partition"]),
                int(seen["llmq.dlq.source.offset"])) == where
    else:
        assert letter is None, f"{case.name} was dead-lettered: {header_dict(letter.headers())}"
        answers, n = _answers(run, case)
        assert len(answers) > n, f"no response for {case.name} ({case.request_id!r})"
        resp = answers[n]
        assert resp.status is case.expect.status, resp.reason
        if case.expect.reason_prefix is None:
            assert resp.reason is None
        else:
            assert resp.reason and resp.reason.startswith(case.expect.reason_prefix), resp.reason
        if case.expect.check is not None:
            case.expect.check(resp)


def test_every_message_got_exactly_one_outcome(run: Run):
    answers = sum(len(v) for v in run.responses.values())
    assert answers == sum(isinstance(c.expect, Answer) for c in CASES) + len(run.sentinels)
    assert len(run.letters) == sum(isinstance(c.expect, Dlq) for c in CASES)
    assert run.stats.consumed == len(CASES) + len(run.sentinels)
    assert run.stats.delivered == run.stats.consumed


def test_a_copy_is_given_the_first_answer_again(run: Run):
    rid = next(c.request_id for c in CASES if c.name == "duplicate_request_id_second")
    first, copy = run.responses[rid]
    assert copy == first  # the same bytes: started_at and finished_at included


def test_the_sentinels_after_the_corpus_were_completed(run: Run):
    for tp, rid in run.sentinels.items():
        answers = run.responses.get(rid)
        assert answers and [a.status for a in answers] == [Status.COMPLETED], f"sentinel of {tp}: {answers}"


def test_the_worker_never_raised(run: Run):
    assert not run.errors, run.errors
    assert run.fatal is None


def test_the_worker_used_the_configured_limits(run: Run):
    assert run.codec_limits == LIMITS


def test_offsets_are_committed_to_the_end(run: Run):
    assert run.ends
    for tp, end in run.ends.items():
        if end > 0:
            assert run.committed[tp] == end, f"{tp}: committed {run.committed[tp]}, end {end}"


def test_the_whole_corpus_is_answered_fast(run: Run):
    # Includes the messages claiming 2**62 map entries or string bytes.
    assert 0 < run.processing_s < 5.0, run.processing_s


# -- a dead letter larger than the producer's message.max.bytes ----------------------------------

# Found by this corpus: the copy (original + ~300 bytes of llmq.dlq.* headers) used to exceed
# the worker producer's message.max.bytes, and the worker died on it at every restart.
@pytest.mark.parametrize("shape", ["near_limit_value", "tiny_value_near_limit_headers"])
def test_a_near_limit_message_is_dead_lettered_without_killing_the_worker(settings, shape):
    topic = settings.topics.request_topic(Priority.NORMAL)
    # A plain producer with librdkafka's defaults accepts this message as it is.
    if shape == "near_limit_value":
        value, headers = b"X" * 999_800, None
    else:
        value, headers = b"X", [("padding", b"p" * 999_700)]
    producer = Producer({"bootstrap.servers": settings.kafka.bootstrap})
    producer.produce(topic, value, b"k", partition=0, headers=headers)
    sentinel = Request.new("tenant-sentinel", "after the big one")
    producer.produce(topic, Codec.default().encode_request(sentinel), b"k", partition=0)
    assert producer.flush(30) == 0

    errors = []
    answered = False
    try:
        with running_worker(settings) as worker:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                msgs = read_topic(settings.kafka.bootstrap, settings.topics.responses, timeout=1)
                if any(Codec.default().decode_response(m.value()).request_id == sentinel.request_id for m in msgs):
                    answered = True
                    break
                if worker.stats.consumed and worker.consumer is None:  # the loop is gone
                    break
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)
    assert not errors, f"the worker raised: {errors[0]!r}"
    assert answered, "the sentinel after the near-limit message was never answered"
    letters = read_topic(settings.kafka.bootstrap, settings.topics.dlq, timeout=10)
    assert [len(m.value()) for m in letters] == [len(value)]
