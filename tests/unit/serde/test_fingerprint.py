"""CRC-64-AVRO fingerprints against the spec's seed and fastavro's implementation."""

from __future__ import annotations

import json

import pytest
from fastavro.schema import fingerprint as fastavro_fingerprint
from fastavro.schema import to_parsing_canonical_form
from hypothesis import given
from hypothesis import strategies as st

from pipeline.serde.fingerprint import (
    EMPTY,
    Fingerprint,
    canonical_fingerprint,
    canonical_form,
    crc64_avro,
    fingerprint_from_bytes,
    schema_fingerprint,
)
from tests.unit.serde import HISTORY_DIR, SCHEMAS_DIR, load_json

ALL_SCHEMA_FILES = sorted(SCHEMAS_DIR.glob("*.avsc")) + sorted(HISTORY_DIR.glob("*.avsc"))


def test_empty_input_is_the_seed():
    assert EMPTY == 0xC15D213AA4D7A795
    assert crc64_avro(b"") == EMPTY


def test_fastavro_prints_the_little_endian_bytes():
    # fastavro's hex string is the wire (little-endian) byte order, not the number.
    assert fastavro_fingerprint("", "CRC-64-AVRO") == EMPTY.to_bytes(8, "little").hex()


@pytest.mark.parametrize("path", ALL_SCHEMA_FILES, ids=lambda p: p.name)
def test_schema_fingerprints_match_fastavro(path):
    schema = load_json(path)
    pcf = to_parsing_canonical_form(schema)
    fp = schema_fingerprint(schema)
    assert isinstance(fp, Fingerprint)
    assert fp.le_bytes == fp.value.to_bytes(8, "little")
    assert fp.hex == fastavro_fingerprint(pcf, "CRC-64-AVRO")
    assert fp == canonical_fingerprint(pcf)
    assert canonical_form(schema) == pcf


@pytest.mark.parametrize(
    "schema",
    ["null", "int", "string", {"type": "array", "items": "long"}, {"type": "fixed", "name": "F", "size": 16}],
)
def test_small_schema_fingerprints_match_fastavro(schema):
    pcf = to_parsing_canonical_form(schema)
    assert schema_fingerprint(schema).hex == fastavro_fingerprint(pcf, "CRC-64-AVRO")


@given(st.text())
def test_crc_matches_fastavro_on_any_text(text):
    assert crc64_avro(text.encode()).to_bytes(8, "little").hex() == fastavro_fingerprint(text, "CRC-64-AVRO")


def test_docs_defaults_and_logical_types_do_not_change_the_fingerprint():
    schema = load_json(SCHEMAS_DIR / "llm_request.avsc")
    bare = json.loads(json.dumps(schema))
    bare.pop("doc")
    for f in bare["fields"]:
        f.pop("doc", None)
        f.pop("default", None)
        if isinstance(f["type"], dict):
            f["type"].pop("logicalType", None)
            f["type"].pop("doc", None)
    assert schema_fingerprint(bare) == schema_fingerprint(schema)


def test_fingerprint_from_bytes():
    fp = schema_fingerprint("int")
    assert fingerprint_from_bytes(fp.le_bytes) == fp
    assert fingerprint_from_bytes(bytearray(fp.le_bytes)) == fp
    with pytest.raises(ValueError):
        fingerprint_from_bytes(b"\x00" * 7)
