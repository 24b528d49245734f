"""CRC-64-AVRO (Rabin) schema fingerprints, as defined by the Avro specification.

The fingerprint of a schema is the 64-bit Rabin fingerprint of the UTF-8 bytes of its
Parsing Canonical Form (PCF). The PCF keeps only what affects the binary encoding
(names, types, fields, symbols, items, values, sizes): docs, defaults, aliases and
logical types do not change the fingerprint.

Avro single-object encoding carries the fingerprint as 8 little-endian bytes.
Note that fastavro's ``fingerprint(pcf, "CRC-64-AVRO")`` returns the hex of those
little-endian bytes, not the hex of the 64-bit number.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from fastavro.schema import to_parsing_canonical_form

__all__ = [
    "EMPTY",
    "Fingerprint",
    "canonical_fingerprint",
    "canonical_form",
    "crc64_avro",
    "fingerprint_from_bytes",
    "schema_fingerprint",
]

#: The CRC-64-AVRO seed, and the fingerprint of empty input.
EMPTY = 0xC15D213AA4D7A795


def _make_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (EMPTY & -(fp & 1))
        table.append(fp)
    return tuple(table)


_TABLE = _make_table()


def crc64_avro(data: bytes) -> int:
    """The CRC-64-AVRO fingerprint of ``data`` as an unsigned 64-bit int."""
    fp = EMPTY
    table = _TABLE
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


class Fingerprint(NamedTuple):
    """A schema fingerprint as an int and as the 8 little-endian bytes on the wire."""

    value: int
    le_bytes: bytes

    @property
    def hex(self) -> str:
        """Hex of the little-endian bytes (the form fastavro and Avro tools print)."""
        return self.le_bytes.hex()


def canonical_form(schema: Any) -> str:
    """The Parsing Canonical Form of a schema (a JSON string, dict, list or parsed schema)."""
    return to_parsing_canonical_form(schema)


def canonical_fingerprint(pcf: str) -> Fingerprint:
    """The CRC-64-AVRO fingerprint of an already computed Parsing Canonical Form."""
    value = crc64_avro(pcf.encode("utf-8"))
    return Fingerprint(value, value.to_bytes(8, "little"))


def schema_fingerprint(schema: Any) -> Fingerprint:
    """The CRC-64-AVRO fingerprint of ``schema``'s Parsing Canonical Form."""
    return canonical_fingerprint(canonical_form(schema))


def fingerprint_from_bytes(le_bytes: bytes) -> Fingerprint:
    """A :class:`Fingerprint` from the 8 little-endian bytes of a single-object header."""
    if len(le_bytes) != 8:
        raise ValueError(f"a CRC-64-AVRO fingerprint has 8 bytes, got {len(le_bytes)}")
    return Fingerprint(int.from_bytes(le_bytes, "little"), bytes(le_bytes))
