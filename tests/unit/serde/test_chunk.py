"""The chunk record (streamed pieces of answers): round trips, framing, caps, hostile bytes,
a schema directory without it, and its topic."""

from __future__ import annotations

import random
import shutil

import pytest

from pipeline.config import Settings, TopicSettings
from pipeline.errors import DecodeError, EncodeError, SchemaNotFoundError
from pipeline.models import Chunk, Request
from pipeline.serde import CHUNK_SCHEMA, SINGLE_OBJECT_MAGIC, Codec, RegistryFormat, SchemaStore, SerdeLimits
from pipeline.serde.fingerprint import schema_fingerprint
from pipeline.topics import TopicSpec, pipeline_topics
from tests.unit.serde import (
    SCHEMAS_DIR,
    avro_body,
    copy_schema_dir,
    full_chunk,
    full_request,
    full_response,
    load_json,
    minimal_chunk,
    zigzag,
)


@pytest.fixture(scope="module")
def store() -> SchemaStore:
    return SchemaStore.load(SCHEMAS_DIR)


@pytest.fixture(scope="module")
def codec(store) -> Codec:
    return Codec(store)


def _refused(codec: Codec, data) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        codec.decode_chunk(data)
    return info.value


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [full_chunk, minimal_chunk], ids=["all-optional-set", "all-optional-unset"])
def test_chunk_round_trip(codec, make):
    chunk = make()
    assert codec.decode_chunk(codec.encode_chunk(chunk)) == chunk


def test_a_stream_round_trips_in_order(codec):
    req = Request.new("tenant", "tell me")
    pieces = ["Once", " upon", " a time ✓", ""]
    chunks = [Chunk.for_request(req, i, text, worker_id="w-1", finish_reason="stop" if i == 3 else None)
              for i, text in enumerate(pieces)]
    back = [codec.decode_chunk(codec.encode_chunk(c)) for c in chunks]
    assert back == chunks
    assert [c.seq for c in back] == [0, 1, 2, 3] and "".join(c.delta for c in back) == "Once upon a time ✓"
    assert [c.last for c in back] == [False, False, False, True]
    assert {(c.request_id, c.tenant_id) for c in back} == {(req.request_id, "tenant")}


def test_extreme_values_round_trip(codec):
    chunk = full_chunk(seq=2**31 - 1, emitted_at=-(2**63), delta="\x00" * 3)
    assert codec.decode_chunk(codec.encode_chunk(chunk)) == chunk


def test_single_object_header_and_body(codec, store):
    data = codec.encode_chunk(full_chunk())
    schema = load_json(SCHEMAS_DIR / "llm_chunk.avsc")
    assert data[:2] == SINGLE_OBJECT_MAGIC
    assert data[2:10] == schema_fingerprint(schema).le_bytes == store.current_revision(CHUNK_SCHEMA).fingerprint.le_bytes
    assert data[10:] == avro_body(schema, full_chunk().to_record())  # what fastavro itself writes
    assert Codec.wire_format(data) == "single-object"


def test_confluent_wire_format(store):
    registry = RegistryFormat.from_url("mock://llmq-chunks")
    codec = Codec(store, registry=registry)
    data = codec.encode_chunk(full_chunk(), wire="confluent", topic="llm.chunks")
    assert data[:1] == b"\x00" and data[5:] == codec.encode_chunk(full_chunk())[10:]
    assert "llm.chunks-value" in registry.client.get_subjects()
    assert codec.decode_chunk(data) == full_chunk()
    with pytest.raises(SchemaNotFoundError) as info:
        codec.decode_request(data)
    assert info.value.reason == "unknown_schema_id"
    with pytest.raises(EncodeError, match="topic"):
        codec.encode_chunk(full_chunk(), wire="confluent")
    with pytest.raises(EncodeError, match="registry"):
        Codec(store).encode_chunk(full_chunk(), wire="confluent", topic="llm.chunks")


# -- framing and hostile bytes: the same reasons as the other records ---------------------------


def test_too_large_comes_before_anything_else(store):
    small = Codec(store, SerdeLimits(max_record_bytes=100))
    assert _refused(small, b"\xff" * 101).reason == "too_large"
    assert _refused(small, b"\xc3\x01" + bytes(99)).reason == "too_large"
    with pytest.raises(EncodeError, match="max_record_bytes"):
        small.encode_chunk(full_chunk(delta="d" * 200))


def test_every_truncation_is_truncated(codec):
    data = codec.encode_chunk(full_chunk())
    for cut in range(len(data)):
        assert _refused(codec, data[:cut]).reason == "truncated", cut


@pytest.mark.parametrize("data", [b"\x01", b"\xff\xff", b"{}", b"\xc3\x02" + bytes(20)])
def test_bad_magic(codec, data):
    assert _refused(codec, data).reason == "bad_magic"


def test_fingerprints_of_other_records_are_unknown_to_the_chunk_reader(codec):
    for other in (codec.encode_request(full_request()), codec.encode_response(full_response())):
        error = _refused(codec, other)
        assert error.reason == "unknown_fingerprint" and "LLMChunk" in str(error)
    chunk = codec.encode_chunk(full_chunk())
    for decode in (codec.decode_request, codec.decode_response):
        with pytest.raises(SchemaNotFoundError) as info:
            decode(chunk)
        assert info.value.reason == "unknown_fingerprint" and "llm_chunk revision 1" in str(info.value)
    assert _refused(codec, chunk[:2] + bytes(8) + chunk[10:]).reason == "unknown_fingerprint"


def test_the_body_rules(codec):
    data = codec.encode_chunk(minimal_chunk(tenant_id="ab", seq=5))
    seq_at = 10 + 1 + 36 + 3  # header, request_id, tenant "ab"
    assert data[seq_at:seq_at + 1] == zigzag(5)
    assert _refused(codec, data + b"\x00").reason == "malformed"  # trailing bytes
    error = _refused(codec, data[:seq_at] + zigzag(2**31) + data[seq_at + 1:])
    assert error.reason == "invalid_field" and "LLMChunk.seq" in error.detail
    assert _refused(codec, data[:seq_at] + b"\x80" * 10 + b"\x00" + data[seq_at + 1:]).reason == "malformed"
    # delta "", finish_reason (branch 0), emitted_at 0, worker_id (branch 0): a byte each
    assert data.endswith(bytes(4))
    for at, field in ((len(data) - 3, "finish_reason"), (len(data) - 1, "worker_id")):
        error = _refused(codec, data[:at] + zigzag(2) + data[at + 1:])
        assert error.reason == "invalid_field" and f"LLMChunk.{field}" in error.detail
    tenant_at = data.index(b"\x04ab")
    assert _refused(codec, data[:tenant_at + 1] + b"\xff\xfe" + data[tenant_at + 3:]).reason == "malformed"
    assert _refused(codec, data[:10] + zigzag(2**62)).reason == "truncated"
    assert _refused(codec, "not bytes").reason == "malformed"  # type: ignore[arg-type]
    assert codec.decode_chunk(bytearray(data)) == codec.decode_chunk(memoryview(data))


def test_random_bytes_only_ever_give_decode_errors(codec):
    """Mutations of a valid chunk: a DecodeError with a known reason, or a Chunk."""
    rng = random.Random(7)
    valid = codec.encode_chunk(full_chunk())
    reasons = {"too_large", "truncated", "bad_magic", "unknown_fingerprint", "unknown_schema_id", "malformed",
               "invalid_field", "limit_exceeded"}
    for _ in range(3000):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(2, len(data))
            choice = rng.random()
            if choice < 0.6:
                data[at] = rng.randrange(256)
            elif choice < 0.8:
                del data[at:at + rng.randint(1, 8)]
            else:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        try:
            assert type(codec.decode_chunk(bytes(data))) is Chunk
        except DecodeError as exc:
            assert exc.reason in reasons, exc


# -- caps -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tight(store) -> tuple[Codec, Codec]:
    lenient = Codec(store, SerdeLimits(max_output_bytes=10**6, max_string_bytes=10**6))
    strict = Codec(store, SerdeLimits(max_output_bytes=70, max_string_bytes=40))
    return lenient, strict


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"delta": "d" * 71}, "LLMChunk.delta: 71 bytes exceed max_output_bytes=70"),
    ({"delta": "€" * 24}, "LLMChunk.delta: 72 bytes exceed max_output_bytes=70"),  # bytes, not characters
    ({"tenant_id": "t" * 41}, "LLMChunk.tenant_id: 41 bytes exceed max_string_bytes=40"),
    ({"finish_reason": "f" * 41}, "LLMChunk.finish_reason"),
    ({"worker_id": "w" * 41}, "LLMChunk.worker_id"),
])
def test_chunk_caps(tight, overrides, needle):
    lenient, strict = tight
    data = lenient.encode_chunk(full_chunk(**overrides))
    error = _refused(strict, data)
    assert error.reason == "limit_exceeded" and needle in error.detail
    with pytest.raises(EncodeError, match=needle.split(":")[0]):
        strict.encode_chunk(full_chunk(**overrides))


def test_a_delta_has_the_output_cap_not_the_string_cap(tight):
    _, strict = tight
    chunk = full_chunk(delta="d" * 70)  # over max_string_bytes, at max_output_bytes
    assert strict.decode_chunk(strict.encode_chunk(chunk)) == chunk


# -- encode errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"seq": True}, "LLMChunk.seq"),
    ({"seq": 1.5}, "LLMChunk.seq"),
    ({"seq": 2**31}, "seq"),
    ({"emitted_at": None}, "LLMChunk.emitted_at"),
    ({"delta": None}, "delta"),
    ({"delta": b"bytes"}, "delta"),
    ({"finish_reason": 3}, "finish_reason"),
])
def test_encode_errors_name_the_field(codec, overrides, needle):
    with pytest.raises(EncodeError) as info:
        codec.encode_chunk(full_chunk(**overrides))
    assert "LLMChunk" in str(info.value) and needle in str(info.value)


def test_encode_chunk_takes_only_chunks(codec):
    with pytest.raises(EncodeError, match="needs a Chunk"):
        codec.encode_chunk(full_response())  # type: ignore[arg-type]
    with pytest.raises(EncodeError):
        codec.encode_response(full_chunk())  # type: ignore[arg-type]


# -- a schema directory without chunks (an older deployment's) --------------------------------------


@pytest.fixture(scope="module")
def chunkless(tmp_path_factory) -> Codec:
    root = copy_schema_dir(tmp_path_factory.mktemp("chunkless") / "schemas")
    (root / "llm_chunk.avsc").unlink()
    shutil.rmtree(root / "history")
    shutil.copytree(SCHEMAS_DIR / "history", root / "history", ignore=shutil.ignore_patterns("llm_chunk.*"))
    return Codec(SchemaStore.load(root))


def test_a_store_without_chunks_still_serves_requests_and_responses(chunkless, codec):
    assert CHUNK_SCHEMA not in chunkless.store.names()
    assert chunkless.decode_request(codec.encode_request(full_request())) == full_request()
    assert codec.decode_response(chunkless.encode_response(full_response())) == full_response()


def test_a_store_without_chunks_refuses_them(chunkless, codec):
    with pytest.raises(EncodeError, match="no llm_chunk schema"):
        chunkless.encode_chunk(full_chunk())
    with pytest.raises(SchemaNotFoundError) as info:
        chunkless.decode_chunk(codec.encode_chunk(full_chunk()))
    assert info.value.reason == "unknown_fingerprint"
    assert _refused(chunkless, b"\xc3\x01" + bytes(2_000_000)).reason == "too_large"  # size still first


# -- the model ---------------------------------------------------------------------------------------


def test_chunk_for_request_copies_the_ids_and_stamps_now():
    req = Request.new("tenant-9", "p")
    chunk = Chunk.for_request(req, 3, "abc", worker_id="w")
    assert (chunk.request_id, chunk.tenant_id, chunk.seq, chunk.delta, chunk.worker_id) == (
        req.request_id, "tenant-9", 3, "abc", "w")
    assert chunk.finish_reason is None and not chunk.last and chunk.emitted_at >= req.created_at
    assert Chunk.for_request(req, 0, "", emitted_at=5, finish_reason="length").emitted_at == 5


def test_chunk_is_keyword_only():
    with pytest.raises(TypeError):
        Chunk("id", "t", 0, "d")  # type: ignore[misc]


def test_chunk_from_record_needs_the_required_fields():
    rec = full_chunk().to_record()
    assert list(rec) == [f["name"] for f in load_json(SCHEMAS_DIR / "llm_chunk.avsc")["fields"]]
    assert Chunk.from_record({k: v for k, v in rec.items() if k not in ("finish_reason", "worker_id")}) == full_chunk(
        finish_reason=None, worker_id=None)
    with pytest.raises(KeyError):
        Chunk.from_record({k: v for k, v in rec.items() if k != "seq"})


# -- the topic -------------------------------------------------------------------------------------------


def test_the_chunk_topic_and_its_spec():
    settings = Settings()
    t = settings.topics
    assert t.chunks == "llm.chunks" and TopicSettings(prefix="staging.llm").chunks == "staging.llm.chunks"
    assert t.chunk_partitions == t.response_partitions == 6
    specs = {s.name: s for s in pipeline_topics(settings)}
    spec = specs["llm.chunks"]
    assert spec == TopicSpec("llm.chunks", 6, t.replication_factor, {"retention.ms": str(24 * 3600 * 1000)},
                             "streamed chunks")
    assert [s.role for s in specs.values()].count("streamed chunks") == 1
    t.response_partitions, t.chunk_config = 24, {"retention.ms": "3600000"}
    spec = next(s for s in pipeline_topics(settings) if s.role == "streamed chunks")
    assert (spec.partitions, spec.config) == (24, {"retention.ms": "3600000"})
