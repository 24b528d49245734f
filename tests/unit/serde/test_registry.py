"""Confluent wire format through confluent-kafka's mock:// schema registry."""

from __future__ import annotations

import json

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

from pipeline.errors import DecodeError, EncodeError, SchemaNotFoundError, SerdeError
from pipeline.models import Status
from pipeline.serde import Codec, RegistryFormat, SchemaStore
from pipeline.serde.registry import record_name_strategy, topic_record_name_strategy
from tests.unit.serde import (
    SCHEMAS_DIR,
    avro_body,
    full_request,
    full_response,
    history_schema,
    minimal_request,
    minimal_response,
    write_schema_dir,
)

TOPIC = "llmq.requests"

# What a reader fills in for the fields a revision 1 writer lacks, and a revision 1 reader
# for the fields it lacks itself.
_REQUEST_REV1_DEFAULTS = dict(notify_queued=False, trace_id=None, admitted_at=None, effective_priority=None,
                              degraded_from=None, messages=[], temperature=None, top_p=None, stop=[], user=None,
                              stream=False, reply_to=None, reply_partition=None)
_RESPONSE_REV1_DEFAULTS = dict(queue_position=None, eta_ms=None, finish_reason=None, usage_estimated=False)


@pytest.fixture(scope="module")
def store() -> SchemaStore:
    return SchemaStore.load(SCHEMAS_DIR)


@pytest.fixture
def registry() -> RegistryFormat:
    return RegistryFormat.from_url("mock://llmq-tests")


@pytest.fixture
def codec(store, registry) -> Codec:
    return Codec(store, registry=registry)


def _reason(excinfo) -> str:
    return excinfo.value.reason


def test_mock_url_needs_new_client():
    mock = RegistryFormat.from_url("mock://x").client
    assert type(mock).__name__ == "MockSchemaRegistryClient"
    # The plain constructor makes a real HTTP client even for a mock:// URL.
    assert type(SchemaRegistryClient({"url": "mock://x"})).__name__ == "SchemaRegistryClient"


@pytest.mark.parametrize("make", [full_request, minimal_request])
def test_request_round_trip(codec, registry, make):
    req = make()
    data = codec.encode_request(req, wire="confluent", topic=TOPIC)
    schema_id = registry.client.get_latest_version(f"{TOPIC}-value").schema_id
    assert data[:1] == b"\x00"
    assert data[1:5] == schema_id.to_bytes(4, "big")
    assert Codec.wire_format(data) == "confluent"
    assert codec.decode_request(data) == req


@pytest.mark.parametrize("make", [full_response, minimal_response])
def test_response_round_trip(codec, registry, make):
    resp = make()
    data = codec.encode_response(resp, wire="confluent", topic="llmq.responses")
    assert codec.decode_response(data) == resp
    assert "llmq.responses-value" in registry.client.get_subjects()


def test_body_is_the_same_as_single_object(codec):
    req = full_request()
    assert codec.encode_request(req, wire="confluent", topic=TOPIC)[5:] == codec.encode_request(req)[10:]


def test_registered_schema_is_the_published_one(codec, registry, store):
    codec.encode_request(full_request(), wire="confluent", topic=TOPIC)
    registered = registry.client.get_latest_version(f"{TOPIC}-value").schema
    assert registered.schema_type == "AVRO"
    assert json.loads(registered.schema_str) == store.current_revision("llm_request").raw


def test_ids_are_cached(codec, registry, monkeypatch):
    codec.encode_request(full_request(), wire="confluent", topic=TOPIC)
    calls = []
    monkeypatch.setattr(registry.client, "register_schema", lambda *a, **k: calls.append(a))
    codec.encode_request(full_request(), wire="confluent", topic=TOPIC)
    assert calls == []


def test_ids_are_fetched_and_cached_when_decoding(store, registry):
    producer = Codec(store, registry=registry)
    data = producer.encode_request(full_request(), wire="confluent", topic=TOPIC)
    consumer_format = RegistryFormat(registry.client)  # fresh caches, same registry
    calls = []
    real_get = consumer_format.client.get_schema

    def counting_get(schema_id, *args, **kwargs):
        calls.append(schema_id)
        return real_get(schema_id, *args, **kwargs)

    consumer_format.client.get_schema = counting_get
    consumer = Codec(store, registry=consumer_format)
    for _ in range(3):
        assert consumer.decode_request(data) == full_request()
    assert calls == [int.from_bytes(data[1:5], "big")]


def test_subject_strategies(store):
    fmt = RegistryFormat.from_url("mock://strategies", record_name_strategy)
    Codec(store, registry=fmt).encode_request(full_request(), wire="confluent", topic=TOPIC)
    assert fmt.client.get_subjects() == ["io.llmq.v1.LLMRequest"]
    fmt = RegistryFormat.from_url("mock://strategies2", topic_record_name_strategy)
    Codec(store, registry=fmt).encode_request(full_request(), wire="confluent", topic=TOPIC)
    assert fmt.client.get_subjects() == [f"{TOPIC}-io.llmq.v1.LLMRequest"]


def test_revision_1_writer_through_registry(codec, registry):
    rev1 = history_schema("llm_request", 1)
    schema_id = registry.client.register_schema(f"{TOPIC}-value", Schema(json.dumps(rev1), "AVRO"))
    record = full_request().to_record()
    data = b"\x00" + schema_id.to_bytes(4, "big") + avro_body(rev1, record)
    assert codec.decode_request(data) == full_request(**_REQUEST_REV1_DEFAULTS)


def test_current_writer_to_revision_1_reader_through_registry(codec, registry, tmp_path):
    root = write_schema_dir(
        tmp_path / "s",
        history={"llm_request": [history_schema("llm_request", 1)], "llm_response": [history_schema("llm_response", 1)]},
        current={"llm_request": history_schema("llm_request", 1), "llm_response": history_schema("llm_response", 1)},
    )
    old = Codec(SchemaStore.load(root), registry=RegistryFormat(registry.client))
    data = codec.encode_request(full_request(), wire="confluent", topic=TOPIC)
    # The old consumer has never heard of revisions 2 to 4: the registry tells it.
    assert old.decode_request(data) == full_request(**_REQUEST_REV1_DEFAULTS)


def _future_response_schema(symbol: str) -> dict:
    """A later response revision (not published here) with one more Status symbol."""
    schema = history_schema("llm_response", 3)
    for f in schema["fields"]:
        if f["name"] == "status":
            f["type"]["symbols"].append(symbol)
    return schema


def test_a_status_unknown_to_the_reader_reads_as_its_default_queued(codec, registry):
    """The enum default at work: a newer writer's symbol this reader lacks becomes QUEUED."""
    future = _future_response_schema("PREEMPTED")
    schema_id = registry.client.register_schema("llm.responses-value", Schema(json.dumps(future), "AVRO"))
    header = b"\x00" + schema_id.to_bytes(4, "big")
    record = full_response().to_record()
    resp = codec.decode_response(header + avro_body(future, {**record, "status": "PREEMPTED"}))
    assert resp.status is Status.QUEUED and not resp.status.is_terminal
    assert resp.request_id == full_response().request_id and resp.eta_ms == 4_200
    # Symbols both know are untouched.
    assert codec.decode_response(header + avro_body(future, record)) == full_response()


def test_revision_1_reader_cannot_read_queued_but_reads_the_rest(codec, registry, tmp_path):
    """Revision 1 has neither QUEUED nor an enum default: only clients on revision 2 may ask for QUEUED."""
    root = write_schema_dir(
        tmp_path / "s",
        history={"llm_request": [history_schema("llm_request", 1)], "llm_response": [history_schema("llm_response", 1)]},
        current={"llm_request": history_schema("llm_request", 1), "llm_response": history_schema("llm_response", 1)},
    )
    old = Codec(SchemaStore.load(root), registry=RegistryFormat(registry.client))
    data = codec.encode_response(full_response(), wire="confluent", topic=TOPIC)
    assert old.decode_response(data) == full_response(**_RESPONSE_REV1_DEFAULTS)
    queued = codec.encode_response(full_response(status=Status.QUEUED), wire="confluent", topic=TOPIC)
    with pytest.raises(DecodeError) as info:
        old.decode_response(queued)
    assert _reason(info) == "invalid_field" and "QUEUED" in str(info.value)


def test_unknown_schema_id(codec):
    with pytest.raises(SchemaNotFoundError) as info:
        codec.decode_request(b"\x00\x00\x01\x00\x00" + bytes(30))
    assert _reason(info) == "unknown_schema_id"


def test_unknown_ids_are_remembered(registry, store):
    calls = []
    real_get = registry.client.get_schema

    def counting_get(schema_id, *args, **kwargs):
        calls.append(schema_id)
        return real_get(schema_id, *args, **kwargs)

    registry.client.get_schema = counting_get
    codec = Codec(store, registry=registry)
    for _ in range(5):
        with pytest.raises(SchemaNotFoundError):
            codec.decode_request(b"\x00\x00\x00\x03\x09" + bytes(30))
    assert calls == [777]


def test_id_of_the_other_record(codec):
    data = codec.encode_response(full_response(), wire="confluent", topic=TOPIC)
    with pytest.raises(SchemaNotFoundError) as info:
        codec.decode_request(data)
    assert _reason(info) == "unknown_schema_id"
    assert "LLMResponse" in str(info.value)


def test_unbounded_registry_schema_is_refused(codec, registry):
    evil = {
        "type": "record",
        "name": "LLMRequest",
        "namespace": "io.llmq.v1",
        "fields": [{"name": "xs", "type": {"type": "array", "items": "null"}}],
    }
    schema_id = registry.client.register_schema("evil-value", Schema(json.dumps(evil), "AVRO"))
    # Ten bytes claiming 2**62 nulls: refused before fastavro sees them.
    data = b"\x00" + schema_id.to_bytes(4, "big") + b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"
    with pytest.raises(SchemaNotFoundError) as info:
        codec.decode_request(data)
    assert _reason(info) == "unknown_schema_id"
    assert "zero bytes" in str(info.value)


def test_non_avro_registry_schema_is_refused(codec, registry):
    schema_id = registry.client.register_schema("json-value", Schema('{"type": "object"}', "JSON"))
    with pytest.raises(SchemaNotFoundError, match="JSON"):
        codec.decode_request(b"\x00" + schema_id.to_bytes(4, "big") + b"\x00")


def test_truncated_confluent_header(codec):
    for data in (b"\x00", b"\x00\x00\x00\x01"):
        with pytest.raises(DecodeError) as info:
            codec.decode_request(data)
        assert _reason(info) == "truncated"


def test_confluent_guards_match_single_object(codec):
    data = codec.encode_request(full_request(), wire="confluent", topic=TOPIC)
    for cut in range(5, len(data)):
        with pytest.raises(DecodeError) as info:
            codec.decode_request(data[:cut])
        assert _reason(info) == "truncated"
    with pytest.raises(DecodeError) as info:
        codec.decode_request(data + b"\x00")
    assert _reason(info) == "malformed"


class _DownClient:
    """A registry that cannot be reached."""

    def get_schema(self, schema_id, *args, **kwargs):
        raise ConnectionError("connection refused")

    def register_schema(self, subject, schema, *args, **kwargs):
        raise ConnectionError("connection refused")


def test_unreachable_registry_is_not_a_decode_error(store):
    codec = Codec(store, registry=RegistryFormat(_DownClient()))
    with pytest.raises(SerdeError) as info:
        codec.decode_request(b"\x00\x00\x00\x00\x01" + bytes(20))
    assert not isinstance(info.value, DecodeError)
    assert "connection refused" in str(info.value)
    with pytest.raises(EncodeError, match="connection refused"):
        codec.encode_request(full_request(), wire="confluent", topic=TOPIC)


def test_lookup_only_mode(store, registry):
    lookup = RegistryFormat(registry.client, auto_register=False)
    codec = Codec(store, registry=lookup)
    with pytest.raises(EncodeError, match="look up"):
        codec.encode_request(full_request(), wire="confluent", topic=TOPIC)
    Codec(store, registry=registry).encode_request(full_request(), wire="confluent", topic=TOPIC)
    data = codec.encode_request(full_request(), wire="confluent", topic=TOPIC)
    assert codec.decode_request(data) == full_request()


def test_confluent_wire_needs_a_topic(codec):
    with pytest.raises(EncodeError, match="topic"):
        codec.encode_request(full_request(), wire="confluent")
