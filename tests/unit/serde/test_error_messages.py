"""Decode and schema-load errors name schemas by name, revision or fingerprint, never by a path
on this machine: their messages end up in logs and in dead-letter headers."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import DecodeError
from pipeline.serde import Codec, SchemaLoadError, SchemaStore, SerdeLimits
from tests.unit.serde import (
    avro_body,
    copy_schema_dir,
    full_chunk,
    full_request,
    full_response,
    history_schema,
    load_json,
    minimal_request,
    pinned_schema_dir,
    zigzag,
)

MARK = "private-dir-7f3a"  # a directory name that must not show up in any message


def _assert_no_path(text: str) -> None:
    assert MARK not in text, text
    assert "/" not in text, text


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return copy_schema_dir(tmp_path_factory.mktemp("errs") / MARK / "schemas")


@pytest.fixture(scope="module")
def codec(root) -> Codec:
    return Codec(SchemaStore.load(root), SerdeLimits(max_string_bytes=40, max_metadata_entries=2))


def _older_request(revision: int) -> bytes:
    schema = history_schema("llm_request", revision)
    store = SchemaStore.load()
    fp = next(r for r in store.revisions("llm_request") if r.revision == revision).fingerprint
    return b"\xc3\x01" + fp.le_bytes + avro_body(schema, full_request(metadata={}).to_record())


def _decode_errors(codec: Codec) -> list[DecodeError]:
    current = codec.encode_request(full_request(metadata={"a": "b"}))
    bad_inputs = [current[:cut] for cut in range(len(current))]  # every truncation
    for revision in (1, 2, 3):
        older = _older_request(revision)
        bad_inputs += [older[:cut] for cut in range(10, len(older))]
        bad_inputs.append(older + b"\x00")  # trailing
        tenant_at = 10 + 1 + 36  # header, request_id
        bad_inputs.append(older[:tenant_at] + zigzag(-1) + older[tenant_at + 1:])  # negative length
    bad_inputs += [
        current + b"junk",
        codec.encode_response(full_response()),  # the other record's fingerprint
        b"\xc3\x01" + bytes(8) + current[10:],  # unknown fingerprint
        b"\x00\x00\x00\x00\x07" + current[10:],  # no registry
        current[:10] + zigzag(1 << 62),  # huge string length
        current.replace(b"\x02\x02a\x02b\x00", b"\x06" + b"\x02k\x02v" * 3 + b"\x00"),  # 3 entries, cap 2
        current.replace(b"tenant-42", b"tenant-\xff\xfe"),  # invalid UTF-8
    ]
    errors = []
    for data in bad_inputs:
        with pytest.raises(DecodeError) as info:
            codec.decode_request(data)
        errors.append(info.value)
    chunk = codec.encode_chunk(full_chunk())
    for data in [chunk[:cut] for cut in range(len(chunk))] + [chunk + b"\x00", current, chunk[:10] + zigzag(1 << 62)]:
        with pytest.raises(DecodeError) as info:
            codec.decode_chunk(data)
        errors.append(info.value)
    return errors


def test_decode_errors_name_no_path(codec):
    errors = _decode_errors(codec)
    assert {e.reason for e in errors} >= {"truncated", "malformed", "unknown_fingerprint", "unknown_schema_id",
                                          "limit_exceeded"}
    for error in errors:
        _assert_no_path(str(error))


def test_a_fingerprint_of_another_record_is_named_by_revision(codec):
    with pytest.raises(DecodeError) as info:
        codec.decode_request(codec.encode_response(full_response()))
    assert "llm_response revision 3" in str(info.value)
    with pytest.raises(DecodeError) as info:
        codec.decode_chunk(codec.encode_request(minimal_request()))
    assert "llm_request revision 4" in str(info.value) and "LLMChunk" in str(info.value)


def test_decode_errors_of_a_pinned_reader_name_no_path(tmp_path):
    root = pinned_schema_dir(tmp_path / MARK / "schemas", llm_request=1, llm_response=1)
    old = Codec(SchemaStore.load(root, allow_older_current=True))
    current = Codec.default().encode_request(full_request())
    for cut in range(10, len(current)):
        with pytest.raises(DecodeError) as info:
            old.decode_request(current[:cut])
        _assert_no_path(str(info.value))


def _broken(tmp_path, how: str):
    root = copy_schema_dir(tmp_path / MARK / "schemas")
    history = root / "history"
    if how == "current differs":
        schema = load_json(root / "llm_request.avsc")
        schema["doc"] = "edited"
        (root / "llm_request.avsc").write_text(json.dumps(schema))
    elif how == "bad json":
        (history / "llm_response.1.avsc").write_text("{not json")
    elif how == "not utf-8":
        (history / "llm_response.1.avsc").write_bytes(b'{"type": "\xff"}')
    elif how == "unreadable":
        (history / "llm_response.1.avsc").unlink()
        (history / "llm_response.1.avsc").mkdir()
    elif how == "not a record":
        (history / "llm_response.1.avsc").write_text('{"type": "array", "items": "int"}')
    elif how == "invalid avro":
        (history / "llm_response.1.avsc").write_text('{"type": "record", "name": "R", "fields": '
                                                     '[{"name": "a", "type": "nope"}]}')
    elif how == "zero-byte items":
        (history / "llm_response.1.avsc").write_text('{"type": "record", "name": "R", "fields": '
                                                     '[{"name": "a", "type": {"type": "array", "items": "null"}}]}')
    elif how == "bad history name":
        (history / "llm_request.v9.avsc").write_text("{}")
    elif how == "bad current name":
        (root / "llm-request.avsc").write_text("{}")
    elif how == "gap":
        (history / "llm_request.2.avsc").rename(history / "llm_request.5.avsc")
    elif how == "unpublished current":
        for old in history.glob("llm_response.*.avsc"):
            old.unlink()
    elif how == "no history":
        for old in history.iterdir():
            old.unlink()
        history.rmdir()
    return root


@pytest.mark.parametrize("how", ["current differs", "bad json", "not utf-8", "unreadable", "not a record",
                                 "invalid avro", "zero-byte items", "bad history name", "bad current name", "gap",
                                 "unpublished current", "no history"])
def test_schema_load_errors_name_no_path(tmp_path, how):
    root = _broken(tmp_path, how)
    with pytest.raises(SchemaLoadError) as info:
        SchemaStore.load(root)
    _assert_no_path(str(info.value))


def test_schema_load_errors_name_the_revision(tmp_path):
    with pytest.raises(SchemaLoadError, match="llm_response revision 1: not valid JSON"):
        SchemaStore.load(_broken(tmp_path, "bad json"))
