"""Producers and consumers that are not llmq: plain confluent-kafka + fastavro, by the schema alone.

Nothing from `pipeline` is used to write the requests or read the responses here, so these
tests pin the wire contract (Avro single-object encoding of the schemas in schemas/).
"""

from __future__ import annotations

import io
import json
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import fastavro
from confluent_kafka import Producer

from tests.integration.harness import read_topic, running_worker

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def _crc64_avro(data: bytes) -> int:
    # The Rabin fingerprint from the Avro specification, written out independently.
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for b in data:
        fp = (fp >> 8) ^ table[(fp ^ b) & 0xFF]
    return fp


def _single_object(schema_path: Path, record: dict) -> bytes:
    raw = json.loads(schema_path.read_text())
    parsed = fastavro.parse_schema(raw)
    canonical = fastavro.schema.to_parsing_canonical_form(raw)
    body = io.BytesIO()
    fastavro.schemaless_writer(body, parsed, record)
    return b"\xc3\x01" + _crc64_avro(canonical.encode()).to_bytes(8, "little") + body.getvalue()


def _read_response(value: bytes) -> dict:
    assert value[:2] == b"\xc3\x01"
    raw = json.loads((SCHEMAS / "llm_response.avsc").read_text())
    assert value[2:10] == _crc64_avro(fastavro.schema.to_parsing_canonical_form(raw).encode()).to_bytes(8, "little")
    record = fastavro.schemaless_reader(io.BytesIO(value[10:]), fastavro.parse_schema(raw))
    record["request_id"] = str(record["request_id"])  # fastavro reads logicalType uuid as uuid.UUID
    return record


def _request_record(**extra) -> dict:
    return {"request_id": str(uuid.uuid4()), "tenant_id": "tenant-external", "priority": "HIGH",
            "prompt": "written without llmq", "model": "sim-small", "max_tokens": 32,
            "created_at": int(time.time() * 1000), "timeout_ms": 60_000, **extra}


def _produce_and_collect(settings, values: dict[str, bytes]) -> dict[str, dict]:
    producer = Producer({"bootstrap.servers": settings.kafka.bootstrap, "enable.idempotence": True})
    for value in values.values():
        producer.produce("%s.requests.high" % settings.topics.prefix, value, b"tenant-external")
    assert producer.flush(10) == 0
    with running_worker(settings):
        msgs = read_topic(settings.kafka.bootstrap, settings.topics.responses, timeout=60,
                          until=lambda ms: {_read_response(m.value())["request_id"] for m in ms} >= set(values))
    return {r["request_id"]: r for r in map(lambda m: _read_response(m.value()), msgs)}


def test_request_from_an_independent_producer_is_completed(settings):
    record = _request_record()
    responses = _produce_and_collect(settings, {record["request_id"]: _single_object(SCHEMAS / "llm_request.avsc", record)})
    resp = responses[record["request_id"]]
    assert resp["status"] == "COMPLETED"
    assert resp["tenant_id"] == "tenant-external"
    assert resp["requested_priority"] == "HIGH"
    assert resp["output"]


def test_old_and_new_writer_revisions_are_both_served(settings):
    v1 = _request_record()  # revision 1 has no notify_queued / trace_id
    v2 = _request_record(notify_queued=False, trace_id="trace-123")
    v3 = _request_record(admitted_at=None, degraded_from=None)  # revision 3 has no messages
    responses = _produce_and_collect(settings, {
        v1["request_id"]: _single_object(SCHEMAS / "history" / "llm_request.1.avsc", v1),
        v2["request_id"]: _single_object(SCHEMAS / "history" / "llm_request.2.avsc", v2),
        v3["request_id"]: _single_object(SCHEMAS / "history" / "llm_request.3.avsc", v3),
    })
    for record in (v1, v2, v3):
        assert responses[record["request_id"]]["status"] == "COMPLETED"


def test_a_chat_request_from_an_independent_producer_is_completed(settings):
    # What an OpenAI-compatible front door not written with llmq would send: the conversation,
    # its sampling settings, and the prompt rendered for workers on older revisions.
    messages = [{"role": "system", "content": "Be brief.", "name": None},
                {"role": "user", "content": "What is Kafka?", "name": "alice"}]
    record = _request_record(messages=messages, prompt="system: Be brief.\nuser: What is Kafka?", temperature=0.2,
                             top_p=0.9, stop=["\n\n"], user="end-user-1", stream=False)
    responses = _produce_and_collect(settings, {record["request_id"]: _single_object(SCHEMAS / "llm_request.avsc",
                                                                                     record)})
    resp = responses[record["request_id"]]
    assert resp["status"] == "COMPLETED" and resp["output"]
    assert resp["tenant_id"] == "tenant-external"
    # Revision 3 of the response: both fields are there for any reader of the current schema.
    assert type(resp["usage_estimated"]) is bool
    assert resp["finish_reason"] is None or isinstance(resp["finish_reason"], str)


def test_chunks_by_the_schema_alone():
    """A chunk llmq writes reads with plain fastavro, and one plain fastavro writes reads with llmq."""
    from pipeline.models import Chunk
    from pipeline.serde import Codec

    raw = json.loads((SCHEMAS / "llm_chunk.avsc").read_text())
    fingerprint = _crc64_avro(fastavro.schema.to_parsing_canonical_form(raw).encode()).to_bytes(8, "little")
    chunk = Chunk(request_id=str(uuid.uuid4()), tenant_id="tenant-external", seq=3, delta=" tokens ✓",
                  finish_reason=None, emitted_at=int(time.time() * 1000), worker_id="w-1")
    ours = Codec.default().encode_chunk(chunk)
    assert ours[:2] == b"\xc3\x01" and ours[2:10] == fingerprint
    read = fastavro.schemaless_reader(io.BytesIO(ours[10:]), fastavro.parse_schema(raw))
    read["request_id"] = str(read["request_id"])  # logical types: a UUID and a datetime to plain fastavro
    assert read.pop("emitted_at") == datetime.fromtimestamp(chunk.emitted_at / 1000, timezone.utc)
    assert read == {k: v for k, v in chunk.to_record().items() if k != "emitted_at"}
    theirs = _single_object(SCHEMAS / "llm_chunk.avsc", {**chunk.to_record(), "seq": 4, "finish_reason": "stop"})
    back = Codec.default().decode_chunk(theirs)
    assert (back.seq, back.finish_reason, back.last, back.delta) == (4, "stop", True, " tokens ✓")
