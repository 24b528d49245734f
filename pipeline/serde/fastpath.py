"""Schema-specialized Avro encoders and decoders, generated and compiled at load time.

fastavro interprets a parsed schema for every record it reads or writes, goes through
an intermediate dict, and the codec then converts that dict to a model object (and
back). For the one schema revision a codec writes (its *current* revision) this module
instead generates the Python source of two straight-line functions, one field after
the other, and compiles them:

* ``decode(data, pos) -> model``: reads the Avro binary body at ``data[pos:]`` straight
  into a :class:`~pipeline.models.Request`/:class:`~pipeline.models.Response`, enum
  members coming from prebuilt tables;
* ``encode(obj, header) -> bytes | None``: writes ``header`` + the body straight from the
  model's attributes into a ``bytearray``.

Only the Avro types our schemas use are supported: a record of ``string``, ``int``,
``long``, ``boolean``, ``enum``, ``map`` of ``string``, and two-branch unions of
``null`` with one of those. Anything else (and any schema whose fields do not match the
model) makes :func:`compile_codec` raise :class:`UnsupportedSchema`, and the codec keeps
using fastavro. Messages written with other schema revisions always go through
fastavro's schema resolution.

**Decoding** checks everything fastavro's path checks, with the same
:class:`~pipeline.errors.DecodeError` reasons: ``truncated`` (the body ends early, a
string claims more bytes than are left, or a negative number of them, as fastavro's
path has it), ``malformed`` (invalid UTF-8, bytes after the record), ``invalid_field``
(enum or union index out of range, ``int`` outside 32 bits) and ``limit_exceeded`` (the
:class:`~pipeline.serde.limits.SerdeLimits` field caps). Cap and range violations are
reported once the whole body has been read, through the same check the fastavro path
uses (so the same field is named, with the same message); string caps are not even
looked at when the body is shorter than the smallest of them. Only the map entry cap
stops decoding at once, before the map is built.

It is deliberately stricter than fastavro in a few places, where fastavro accepts
bytes no Avro writer produces:

* a boolean byte other than ``00``/``01`` is ``invalid_field`` (fastavro: any non-zero
  byte is ``true``);
* a negative enum or union index is ``invalid_field`` (fastavro indexes the symbol or
  branch list from its end);
* a varint longer than 10 bytes, or a 10-byte one beyond 64 bits, is ``malformed``
  (fastavro silently wraps it around); an ``int`` (field value, enum or union index)
  encoded in more than 5 bytes is ``invalid_field``;
* the map entry cap counts encoded entries, so duplicate keys count too (fastavro's
  path counts the entries of the resulting dict), and a map over the cap is reported
  as soon as its block count is read: ``truncated`` if the rest of the message is too
  short to hold that many entries, else ``limit_exceeded``, even if something later
  in the message is broken as well.

**Encoding** handles the ordinary case only: every value of exactly the expected type
(``str``, ``int`` within range, ``bool``, a member of the field's enum class, a ``dict``
of ``str`` to ``str``) and within the caps. For anything else ``encode`` returns
``None`` and the codec encodes with fastavro, which raises the usual, field-naming
:class:`~pipeline.errors.EncodeError` (or accepts what it accepts). The bytes are
identical to fastavro's.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import linecache
import os
import sys
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping

from pipeline.errors import DecodeError
from pipeline.models import Priority, Request, Response, Status, TaskTier

#: The build of _native.c this code expects (its NATIVE_ABI).
NATIVE_ABI = 3

try:  # built by `pip install` from _native.c when a C compiler is there; optional
    from pipeline.serde import _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None
if _native is not None and getattr(_native, "ABI", None) != NATIVE_ABI:  # pragma: no cover - a stale build
    import logging

    logging.getLogger(__name__).warning(
        "pipeline/serde/_native is a stale build (ABI %s, expected %s); using the Python codec. "
        "Rebuild it: pip install -e .", getattr(_native, "ABI", None), NATIVE_ABI)
    _native = None

__all__ = [
    "FastCodec",
    "FieldCaps",
    "ModelBinding",
    "REQUEST_BINDING",
    "RESPONSE_BINDING",
    "UnsupportedSchema",
    "compile_codec",
    "native_available",
]

_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


class UnsupportedSchema(Exception):
    """The schema (or its fit to the model) is outside what this module generates code for."""


@dataclass(frozen=True)
class ModelBinding:
    """How a record schema maps onto a model dataclass.

    Fields are matched by name. ``enums`` names the model fields that hold enum members
    and their enum class (as ``from_record`` converts them); every other field holds
    the Avro value as it is.
    """

    model: type
    enums: Mapping[str, type[Enum]]


REQUEST_BINDING = ModelBinding(
    Request, {"priority": Priority, "task_tier": TaskTier, "effective_priority": Priority}
)
RESPONSE_BINDING = ModelBinding(
    Response, {"status": Status, "requested_priority": Priority, "served_priority": Priority}
)


@dataclass(frozen=True)
class FieldCaps:
    """The size caps to enforce, by field name.

    ``strings``: string fields (plain or in a union) -> maximum UTF-8 bytes.
    ``maps``: map fields -> (maximum entries, name of that limit for messages, maximum
    UTF-8 bytes of each key and value). Fields not named here are not capped (beyond
    ``max_record_bytes``, which bounds the whole message).
    """

    max_record_bytes: int
    strings: Mapping[str, int] = field(default_factory=dict)
    maps: Mapping[str, tuple[int, str, int]] = field(default_factory=dict)


#: ``late_check(obj)`` -> ``(reason, detail)`` of the first cap/range problem, or None.
LateCheck = Callable[[Any], "tuple[str, str] | None"]


# -- runtime helpers the generated code calls ------------------------------------------
#
# The generated code reads the common cases inline and calls these for the rest. A body
# that ends early shows up as IndexError (``data[pos]`` past the end), which the
# generated function turns into DecodeError("truncated").


def _uvarint(data: bytes, pos: int) -> tuple[int, int]:
    """The raw (unsigned) varint starting at ``data[pos]``: ``(n, next position)``.

    At most 10 bytes, and the tenth may only carry bit 63, so ``n`` < 2**64 (the
    zig-zag encoding of a 64-bit long).
    """
    start = pos
    b = data[pos]
    n = b & 0x7F
    shift = 7
    pos += 1
    while b & 0x80:
        b = data[pos]
        pos += 1
        if shift == 63:
            if b > 1:
                what = "is longer than 10 bytes" if b & 0x80 else "exceeds 64 bits"
                raise DecodeError("malformed", f"the varint at offset {start} {what}")
            n |= b << 63
            break
        n |= (b & 0x7F) << shift
        shift += 7
    return n, pos


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The zig-zag varint (an Avro long) at ``data[pos]``: ``(value, next position)``."""
    n, pos = _uvarint(data, pos)
    return (n >> 1) ^ -(n & 1), pos


def _int(data: bytes, pos: int, where: str) -> tuple[int, int]:
    """A varint for an Avro ``int``: like :func:`_varint`, but at most 5 bytes long.

    A longer one holding a value outside 32 bits is returned as it is (the caller
    reports the range problem the way the fastavro path does).
    """
    value, end = _varint(data, pos)
    if end - pos > 5 and _INT32_MIN <= value <= _INT32_MAX:
        raise DecodeError("invalid_field", f"{where}: int encoded in {end - pos} bytes (at most 5)")
    return value, end


def _negative_length(where: str, n: int) -> DecodeError:
    # "truncated", as the fastavro path reports it (fastavro tries to read -n bytes).
    return DecodeError("truncated", f"{where}: negative length {n}")


def _length(data: bytes, pos: int, where: str) -> tuple[int, int]:
    """A string length that is not a single non-negative byte."""
    b = data[pos]
    if b < 0x80:
        raise _negative_length(where, (b >> 1) ^ -(b & 1))
    c = data[pos + 1]
    if c < 0x80:  # two bytes: lengths 64..8191
        n = (b & 0x7F) | (c << 7)
        if n & 1:
            raise _negative_length(where, (n >> 1) ^ -1)
        return n >> 1, pos + 2
    n, pos = _varint(data, pos)
    if n < 0:
        raise _negative_length(where, n)
    return n, pos


def _index(data: bytes, pos: int, count: int, kind: str, where: str) -> tuple[int, int]:
    """An enum or union index (an Avro int) that the inline table did not accept."""
    index, end = _int(data, pos, where)
    if index < 0:
        raise DecodeError("invalid_field", f"{where}: negative {kind} index {index}")
    if index >= count:
        raise DecodeError("invalid_field", f"{where}: {kind} index {index} out of range (0..{count - 1})")
    return index, end


#: The string length a single byte encodes, or -1 if it does not encode a non-negative
#: number on its own.
_SHORT_LENGTH = tuple(-1 if b & 0x81 else b >> 1 for b in range(256))


#: What the continuation bits of an L-byte varint add up to when its bytes are
#: summed whole (``byte[k] << 7k``).
_CONTINUATION_BITS = {length: sum(1 << (7 * k + 7) for k in range(length - 1)) for length in range(1, 7)}

#: The boolean a byte encodes: only 0x00 and 0x01 do.
_BOOLEAN = (False, True) + (None,) * 254


def _bad_boolean(where: str, byte: int) -> DecodeError:
    return DecodeError("invalid_field", f"{where}: boolean byte {byte:#04x} is neither 0x00 nor 0x01")


def _map_of_strings(
    data: bytes, pos: int, size: int, max_entries: int, limit_name: str, max_bytes: int, where: str
) -> tuple[dict, int, bool]:
    """A map of strings: ``(dict, next position, some key or value over max_bytes)``.

    Stops at a block count that takes the running total of entries over
    ``max_entries``, before reading (or allocating) any of that block.
    """
    out: dict[str, str] = {}
    total = 0
    over = False
    while True:
        b = data[pos]
        if b < 0x80:
            count = (b >> 1) ^ -(b & 1)
            pos += 1
        else:
            count, pos = _varint(data, pos)
        if count == 0:
            return out, pos, over
        if count < 0:  # a negative count is followed by the block's size in bytes (unused)
            count = -count
            b = data[pos]
            if b < 0x80:
                pos += 1
            else:
                _, pos = _varint(data, pos)
        total += count
        if total > max_entries:
            # Each entry takes at least two bytes (key and value lengths), the map's
            # end one more: a count the rest cannot hold means the message is cut.
            if 2 * count + 1 > size - pos:
                raise DecodeError(
                    "truncated", f"{where}: a block of {count} entries cannot fit in the {size - pos} bytes left"
                )
            raise DecodeError("limit_exceeded", f"{where}: {total} entries exceed {limit_name}={max_entries}")
        for _ in range(count):
            b = data[pos]
            if b & 0x81:
                n, pos = _length(data, pos, where)
            else:
                n = b >> 1
                pos += 1
            end = pos + n
            if end > size:
                raise IndexError
            key = data[pos:end].decode()
            if n > max_bytes:
                over = True
            b = data[end]
            if b & 0x81:
                n, pos = _length(data, end, where)
            else:
                n = b >> 1
                pos = end + 1
            end = pos + n
            if end > size:
                raise IndexError
            out[key] = data[pos:end].decode()
            if n > max_bytes:
                over = True
            pos = end


# Varint encoding tables: the 2-byte varint of every 14-bit number with both
# continuation bits set (_CONT14), and its minimal varint (_LAST14, 1 or 2 bytes).
# Built on first use: 2 x 16384 small bytes objects, about 1.3 MB.
_CONT14: list[bytes] = []
_LAST14: list[bytes] = []
_tables_lock = threading.Lock()


def _varint_tables() -> tuple[list[bytes], list[bytes]]:
    with _tables_lock:
        if not _CONT14:
            last = [bytes((i,)) if i < 0x80 else bytes(((i & 0x7F) | 0x80, i >> 7)) for i in range(1 << 14)]
            cont = [bytes(((i & 0x7F) | 0x80, (i >> 7) | 0x80)) for i in range(1 << 14)]
            _LAST14.extend(last)
            _CONT14.extend(cont)
    return _CONT14, _LAST14


def _put_long(out: bytearray, value: int) -> None:
    """Append the zig-zag varint of ``value`` (a 64-bit long) to ``out``."""
    n = (value << 1) ^ (value >> 63)
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _put_map_of_strings(out: bytearray, value: dict, max_entries: int, max_bytes: int) -> bool:
    """Append a non-empty map of strings as fastavro writes it (one block); False to bail."""
    if len(value) > max_entries:
        return False
    _put_long(out, len(value))
    for key, item in value.items():
        if type(key) is not str or type(item) is not str:
            return False
        raw_key = key.encode()
        raw_item = item.encode()
        if len(raw_key) > max_bytes or len(raw_item) > max_bytes:
            return False
        _put_long(out, len(raw_key))
        out += raw_key
        _put_long(out, len(raw_item))
        out += raw_item
    out.append(0)
    return True


# -- schema analysis ---------------------------------------------------------------------

_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
_SCALARS = frozenset({"boolean", "int", "long", "string"})


def _type_of(schema: Any, named: Mapping[str, Any], where: str) -> tuple:
    """A normalized descriptor of a (fastavro-parsed) field type.

    ``("string",)``, ``("int",)``, ``("long",)``, ``("boolean",)``, ``("null",)``,
    ``("enum", fullname, symbols)``, ``("map",)`` (of strings) or ``("union", a, b)``
    (``null`` and one of the others); raises UnsupportedSchema for anything else.
    """
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            if schema in _SCALARS or schema == "null":
                return (schema,)
            raise UnsupportedSchema(f"{where}: type {schema!r}")
        if schema in named:
            return _type_of(named[schema], named, where)
        raise UnsupportedSchema(f"{where}: unknown named type {schema!r}")
    if isinstance(schema, list):
        if len(schema) != 2:
            raise UnsupportedSchema(f"{where}: union of {len(schema)} branches")
        branches = tuple(_type_of(branch, named, where) for branch in schema)
        kinds = [b[0] for b in branches]
        if kinds.count("null") != 1 or "union" in kinds:
            raise UnsupportedSchema(f"{where}: union other than null + one type")
        return ("union", *branches)
    if isinstance(schema, dict):
        kind = schema.get("type")
        if kind == "enum":
            symbols = schema.get("symbols")
            if not isinstance(symbols, list) or not all(isinstance(s, str) for s in symbols):
                raise UnsupportedSchema(f"{where}: enum without a list of symbols")
            return ("enum", schema.get("name"), tuple(symbols))
        if kind == "map":
            values = _type_of(schema.get("values"), named, where + "{}")
            if values != ("string",):
                raise UnsupportedSchema(f"{where}: map of {values[0]}")
            return ("map",)
        if isinstance(kind, str) and kind in _PRIMITIVES:
            # {"type": "long"} (what remains of a logical type), but not {"type": "record"}
            return _type_of(kind, named, where)
        raise UnsupportedSchema(f"{where}: type {kind!r}")
    raise UnsupportedSchema(f"{where}: not a schema: {schema!r}")


# -- code generation ---------------------------------------------------------------------


class _Source:
    """Lines of generated Python plus the namespace its globals come from."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.namespace: dict[str, Any] = {}
        self._names: dict[int, str] = {}

    def line(self, indent: int, text: str) -> None:
        self.lines.append("    " * indent + text)

    def ref(self, value: Any, hint: str) -> str:
        """A global name bound to ``value`` in the generated module (one per object)."""
        key = id(value)
        name = self._names.get(key)
        if name is None:
            name = f"_{hint}{len(self._names)}"
            self._names[key] = name
            self.namespace[name] = value
        return name


class _Field:
    __slots__ = ("name", "type", "var", "enum", "cap", "map_caps", "where")

    def __init__(self, name, type_, var, enum, cap, map_caps, where):
        self.name = name
        self.type = type_
        self.var = var
        self.enum = enum
        self.cap = cap
        self.map_caps = map_caps
        self.where = where


def _enum_tables(enum_cls: type[Enum], symbols: tuple[str, ...], where: str) -> tuple[tuple, tuple, dict]:
    """(members by index, members by the single byte that encodes them, byte string by member)."""
    by_symbol = {member._value_: member for member in enum_cls}
    members = []
    for symbol in symbols:
        member = by_symbol.get(symbol)
        if member is None:
            raise UnsupportedSchema(f"{where}: symbol {symbol!r} is not a {enum_cls.__name__} member")
        members.append(member)
    by_byte: list[Any] = [None] * 256
    for index, member in enumerate(members):
        if 2 * index < 0x80:
            by_byte[2 * index] = member
    encoded = {}
    for index, member in enumerate(members):
        out = bytearray()
        _put_long(out, index)
        encoded.setdefault(member, bytes(out))
    return tuple(members), tuple(by_byte), encoded


def _decode_value(src: _Source, f: _Field, t: tuple, target: str, ind: int) -> None:
    """Lines reading one value of type ``t`` at ``pos`` into ``target``."""
    kind = t[0]
    where = repr(f.where)
    if kind == "string":
        # A length running past the end is not checked here: the slice comes out
        # short, and the next read (or the final position check) fails; a UTF-8
        # error in a short slice is told apart by ``end > size``. Caps are checked
        # once at the end, and only if the body could exceed one.
        src.line(ind, "n = _SHORT_LENGTH[data[pos]]")
        src.line(ind, "if n < 0:")
        src.line(ind + 1, "b = data[pos]")
        src.line(ind + 1, "if b > 0x7F and not b & 1 and data[pos + 1] < 0x80:  # two bytes: 64..8191")
        src.line(ind + 2, "n = ((b & 0x7F) | (data[pos + 1] << 7)) >> 1")
        src.line(ind + 2, "pos += 2")
        src.line(ind + 1, "else:")
        src.line(ind + 2, f"n, pos = _length(data, pos, {where})")
        src.line(ind, "else:")
        src.line(ind + 1, "pos += 1")
        src.line(ind, "end = pos + n")
        src.line(ind, f"{target} = data[pos:end].decode()")
        src.line(ind, "pos = end")
    elif kind == "long":
        # Unrolled up to 6 bytes (epoch milliseconds); anything longer goes to the
        # general loop. The bytes are added whole, continuation bits included, and
        # those bits (known from the length) are taken off once at the end.
        src.line(ind, "b = data[pos]")
        src.line(ind, "if b < 0x80:")
        src.line(ind + 1, f"{target} = (b >> 1) ^ -(b & 1)")
        src.line(ind + 1, "pos += 1")
        src.line(ind, "else:")
        src.line(ind + 1, "u = b")
        depth = ind + 1
        for k in range(1, 4):
            src.line(depth, f"b = data[pos + {k}]")
            src.line(depth, f"u += b << {7 * k}")
            src.line(depth, "if b < 0x80:")
            src.line(depth + 1, f"u -= {_CONTINUATION_BITS[k + 1]:#x}")
            src.line(depth + 1, f"pos += {k + 1}")
            src.line(depth, "else:")
            depth += 1
        src.line(depth, "b = data[pos + 4]")
        src.line(depth, "if b < 0x80:")
        src.line(depth + 1, f"u += (b << 28) - {_CONTINUATION_BITS[5]:#x}")
        src.line(depth + 1, "pos += 5")
        src.line(depth, "else:")
        src.line(depth + 1, "c = data[pos + 5]")
        src.line(depth + 1, "if c < 0x80:  # bytes 5 and 6 joined before the one shift past 30 bits")
        src.line(depth + 2, f"u += ((b + (c << 7)) << 28) - {_CONTINUATION_BITS[6]:#x}")
        src.line(depth + 2, "pos += 6")
        src.line(depth + 1, "else:")
        src.line(depth + 2, "u, pos = _uvarint(data, pos)")
        src.line(ind + 1, f"{target} = ~(u >> 1) if u & 1 else u >> 1")
    elif kind == "int":
        src.line(ind, "b = data[pos]")
        src.line(ind, "if b < 0x80:")
        src.line(ind + 1, f"{target} = (b >> 1) ^ -(b & 1)")
        src.line(ind + 1, "pos += 1")
        src.line(ind, "else:")
        src.line(ind + 1, f"{target}, pos = _int(data, pos, {where})")
        src.line(ind + 1, f"if not {_INT32_MIN} <= {target} <= {_INT32_MAX}:")
        src.line(ind + 2, "late = 1")
    elif kind == "boolean":
        src.line(ind, f"{target} = _BOOLEAN[data[pos]]")
        src.line(ind, f"if {target} is None:")
        src.line(ind + 1, f"raise _bad_boolean({where}, data[pos])")
        src.line(ind, "pos += 1")
    elif kind == "enum":
        members, by_byte, _ = _enum_tables(f.enum, t[2], f.where)
        table = src.ref(by_byte, "bytes_to_member")
        listed = src.ref(members, "members")
        src.line(ind, f"{target} = {table}[data[pos]]")
        src.line(ind, f"if {target} is None:")
        src.line(ind + 1, f"i, pos = _index(data, pos, {len(members)}, 'enum', {where})")
        src.line(ind + 1, f"{target} = {listed}[i]")
        src.line(ind, "else:")
        src.line(ind + 1, "pos += 1")
    elif kind == "map":
        entries, limit_name, max_bytes = f.map_caps
        src.line(ind, "if data[pos] == 0:")
        src.line(ind + 1, f"{target} = {{}}")
        src.line(ind + 1, "pos += 1")
        src.line(ind, "else:")
        src.line(ind + 1, "end = 0  # (the map checks its own lengths)")
        src.line(
            ind + 1,
            f"{target}, pos, over = _map_of_strings(data, pos, size, {entries}, {limit_name!r}, {max_bytes}, {where})",
        )
        src.line(ind + 1, "if over:")
        src.line(ind + 2, "late = 1")
    elif kind == "union":
        null_index = 0 if t[1][0] == "null" else 1
        other = t[2 - null_index]
        value_byte = 2 * (1 - null_index)
        null_byte = 2 * null_index
        src.line(ind, "b = data[pos]")
        src.line(ind, f"if b == {value_byte}:")
        src.line(ind + 1, "pos += 1")
        _decode_value(src, f, other, target, ind + 1)
        src.line(ind, f"elif b == {null_byte}:")
        src.line(ind + 1, "pos += 1")
        src.line(ind + 1, f"{target} = None")
        src.line(ind, "else:  # not a canonical one-byte index")
        src.line(ind + 1, f"i, pos = _index(data, pos, 2, 'union', {where})")
        src.line(ind + 1, f"if i == {null_index}:")
        src.line(ind + 2, f"{target} = None")
        src.line(ind + 1, "else:")
        _decode_value(src, f, other, target, ind + 2)
    else:  # pragma: no cover - _type_of admits nothing else
        raise UnsupportedSchema(f"{f.where}: cannot decode {kind}")


def _encode_value(src: _Source, f: _Field, t: tuple, value: str, ind: int) -> None:
    """Lines appending the encoding of ``value`` (type ``t``) to ``out``; ``return None`` to bail."""
    kind = t[0]
    if kind == "string":
        src.line(ind, f"if type({value}) is not str:")
        src.line(ind + 1, "return None")
        src.line(ind, f"e = {value}.encode()")
        src.line(ind, "n = len(e)")
        if f.cap is not None:
            src.line(ind, f"if n > {f.cap}:")
            src.line(ind + 1, "return None")
        src.line(ind, "if n < 8192:")
        src.line(ind + 1, "out += _LAST14[n << 1]")
        src.line(ind, "else:")
        src.line(ind + 1, "_put_long(out, n)")
        src.line(ind, "out += e")
    elif kind in ("long", "int"):
        low, high = (_INT32_MIN, _INT32_MAX) if kind == "int" else (_INT64_MIN, _INT64_MAX)
        src.line(ind, f"if type({value}) is not int:")
        src.line(ind + 1, "return None")
        src.line(ind, f"if -8192 <= {value} < 8192:")
        src.line(ind + 1, f"out += _LAST14[({value} << 1) ^ ({value} >> 63)]")
        if kind == "long":
            # Epoch milliseconds (2**27 .. 2**41) take 5-6 bytes: three table look-ups.
            src.line(ind, f"elif 134217728 <= {value} < 2199023255552:")
            src.line(ind + 1, f"n = {value} << 1")
            src.line(ind + 1, "out += _CONT14[n & 16383]")
            src.line(ind + 1, "out += _CONT14[(n >> 14) & 16383]")
            src.line(ind + 1, "out += _LAST14[n >> 28]")
        src.line(ind, f"elif {low} <= {value} <= {high}:")
        src.line(ind + 1, f"_put_long(out, {value})")
        src.line(ind, "else:")
        src.line(ind + 1, "return None")
    elif kind == "boolean":
        src.line(ind, f"if {value} is True:")
        src.line(ind + 1, "out.append(1)")
        src.line(ind, f"elif {value} is False:")
        src.line(ind + 1, "out.append(0)")
        src.line(ind, "else:")
        src.line(ind + 1, "return None")
    elif kind == "enum":
        _, _, encoded = _enum_tables(f.enum, t[2], f.where)
        cls = src.ref(f.enum, "enum")
        table = src.ref(encoded, "member_to_bytes")
        src.line(ind, f"if type({value}) is not {cls}:")
        src.line(ind + 1, "return None")
        src.line(ind, f"out += {table}[{value}]  # KeyError (a member the schema lacks): bail")
    elif kind == "map":
        entries, _, max_bytes = f.map_caps
        src.line(ind, f"if type({value}) is not dict:")
        src.line(ind + 1, "return None")
        src.line(ind, f"if not {value}:")
        src.line(ind + 1, "out.append(0)")
        src.line(ind, f"elif not _put_map_of_strings(out, {value}, {entries}, {max_bytes}):")
        src.line(ind + 1, "return None")
    elif kind == "union":
        null_index = 0 if t[1][0] == "null" else 1
        other = t[2 - null_index]
        src.line(ind, f"if {value} is None:")
        src.line(ind + 1, f"out.append({2 * null_index})")
        src.line(ind, "else:")
        src.line(ind + 1, f"out.append({2 * (1 - null_index)})")
        _encode_value(src, f, other, value, ind + 1)
    else:  # pragma: no cover
        raise UnsupportedSchema(f"{f.where}: cannot encode {kind}")


def _fields(parsed: Mapping[str, Any], binding: ModelBinding, caps: FieldCaps, record: str) -> list[_Field]:
    if parsed.get("type") not in ("record", "error"):
        raise UnsupportedSchema(f"{record}: not a record")
    named = parsed.get("__named_schemas") or {}
    model_fields = {f.name: f for f in dataclasses.fields(binding.model)}
    out = []
    for number, spec in enumerate(parsed.get("fields", ())):
        name = spec.get("name")
        where = f"{record}.{name}"
        if name not in model_fields:
            raise UnsupportedSchema(f"{where}: {binding.model.__name__} has no such field")
        t = _type_of(spec.get("type"), named, where)
        if t[0] == "null":
            raise UnsupportedSchema(f"{where}: a null field")
        inner = t
        if t[0] == "union":
            inner = t[1] if t[1][0] != "null" else t[2]
        enum = binding.enums.get(name)
        if (inner[0] == "enum") != (enum is not None):
            raise UnsupportedSchema(f"{where}: Avro {inner[0]} for a model field that holds {enum or 'plain values'}")
        map_caps = None
        if inner[0] == "map":
            map_caps = caps.maps.get(name)
            if map_caps is None:
                unbounded = caps.max_record_bytes
                map_caps = (unbounded, "max_record_bytes", unbounded)
        cap = caps.strings.get(name) if inner[0] == "string" else None
        out.append(_Field(name, t, f"v{number}", enum, cap, map_caps, where))
    return out


def _plain(model: type) -> bool:
    """Whether the dataclass ``model``'s ``__init__`` only stores its arguments, so that an
    object can be filled in attribute by attribute instead."""
    return (
        not hasattr(model, "__post_init__")
        and all(mf.init for mf in dataclasses.fields(model))
        and getattr(model, "__setattr__", object.__setattr__) is object.__setattr__
    )


def _construct(src: _Source, binding: ModelBinding, fields: list[_Field], ind: int) -> None:
    """Lines building ``obj``, the model, from the decoded locals (and model defaults).

    A dataclass whose ``__init__`` only stores its arguments (no ``__post_init__``, no
    ``init=False`` fields) is filled in directly, attribute by attribute, which saves
    the call; otherwise its constructor is called.
    """
    model = binding.model
    if not dataclasses.is_dataclass(model):
        raise UnsupportedSchema(f"{model.__name__} is not a dataclass")
    decoded = {f.name: f.var for f in fields}
    model_fields = dataclasses.fields(model)
    values: list[tuple[dataclasses.Field, str]] = []
    for mf in model_fields:
        if not mf.init:
            if mf.name in decoded:
                raise UnsupportedSchema(f"{model.__name__}.{mf.name} is not an __init__ argument")
            continue
        expr = decoded.get(mf.name)
        if expr is None:
            if mf.default is not dataclasses.MISSING:
                expr = src.ref(mf.default, "default")
            elif mf.default_factory is not dataclasses.MISSING:
                expr = src.ref(mf.default_factory, "factory") + "()"
            else:
                raise UnsupportedSchema(f"{model.__name__}.{mf.name} is required but not in the schema")
        values.append((mf, expr))
    name = src.ref(model, "model")
    if _plain(model):
        src.line(ind, f"obj = _new({name})")
        for mf, expr in values:
            src.line(ind, f"obj.{mf.name} = {expr}")
        return
    positional = [expr for mf, expr in values if not mf.kw_only]
    keywords = [f"{mf.name}={expr}" for mf, expr in values if mf.kw_only]
    src.line(ind, f"obj = {name}({', '.join(positional + keywords)})")


# Generated source -> its code object: codecs built with the same schema and limits
# share one compilation (and one linecache entry).
_compiled: dict[str, Any] = {}
_compiled_lock = threading.Lock()
_serial = itertools.count(1)


def _compile(text: str, what: str, namespace: dict[str, Any]) -> None:
    code = _compiled.get(text)
    if code is None:
        filename = f"<llmq fastpath {what} #{next(_serial)}>"
        code = compile(text, filename, "exec")
        # Tracebacks through generated code show its lines.
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        with _compiled_lock:
            code = _compiled.setdefault(text, code)
    exec(code, namespace)


class FastCodec:
    """The generated ``decode``/``encode`` pair of one schema revision and model.

    ``decode(data, pos)`` reads the body at ``data[pos:]`` (``data`` must be ``bytes``)
    and returns the model object or raises :class:`DecodeError`. ``encode(obj, header)``
    returns ``header`` + body, or ``None`` when ``obj`` needs the general path.
    ``decode_source``/``encode_source`` hold the generated code; ``native`` says both
    try the C twin (``_native.c``) first. With the twin (else None): ``native_decode(data,
    pos)`` is its decoder alone (None where the generated code must decide, which
    ``python_decode`` is), and ``encode_values(values, header)`` encodes the object
    ``model(**dict(zip(field names, values)))`` would be, from the tuple of its field
    values in the model's field order, without building it; None when that object would
    need the general path.
    """

    __slots__ = ("record", "decode", "encode", "decode_source", "encode_source", "python_decode", "native_decode",
                 "encode_values", "native")

    def __init__(self, record, decode, encode, decode_source, encode_source, *, python_decode=None,
                 native_decode=None, encode_values=None):
        self.record = record
        self.decode = decode
        self.encode = encode
        self.decode_source = decode_source
        self.encode_source = encode_source
        self.python_decode = python_decode or decode
        self.native_decode = native_decode
        self.encode_values = encode_values
        self.native = native_decode is not None

    def __repr__(self) -> str:
        return f"FastCodec({self.record})"


def _default_late_check(binding: ModelBinding, fields: list[_Field], record: str) -> LateCheck:
    """Names the first capped field over its cap or ``int`` out of range (generic wording)."""

    def check(obj: Any) -> tuple[str, str] | None:
        for f in fields:
            value = getattr(obj, f.name)
            if value is None:
                continue
            inner = f.type
            if inner[0] == "union":
                inner = inner[1] if inner[1][0] != "null" else inner[2]
            if inner[0] == "string" and f.cap is not None:
                size = len(value.encode("utf-8", "surrogatepass"))
                if size > f.cap:
                    return "limit_exceeded", f"{f.where}: {size} bytes exceed the cap of {f.cap}"
            elif inner[0] == "int" and not _INT32_MIN <= value <= _INT32_MAX:
                return "invalid_field", f"{f.where}: {value!r} is not a 32-bit int"
            elif inner[0] == "map":
                _, _, max_bytes = f.map_caps
                for key, item in value.items():
                    for text in (key, item):
                        size = len(text.encode("utf-8", "surrogatepass"))
                        if size > max_bytes:
                            return "limit_exceeded", f"{f.where}: a key or value of {size} bytes exceeds {max_bytes}"
        return None

    return check


def native_available() -> bool:
    """Whether the C twin of the generated code (``_native.c``) was built and is enabled.

    ``LLMQ_NATIVE_CODEC=0`` turns it off (comparisons, or to rule it out when debugging)."""
    return _native is not None and os.environ.get("LLMQ_NATIVE_CODEC", "1") != "0"


_NATIVE_OPS = {"string": 1, "int": 2, "long": 3, "boolean": 4, "enum": 5, "map": 6}


def _native_program(binding: ModelBinding, fields: list[_Field]) -> tuple | None:
    """The record description ``_native.decode``/``encode`` interpret, or None when the
    model is not filled attribute by attribute (see :func:`_construct`)."""
    model = binding.model
    if not _plain(model):
        return None
    model_fields = dataclasses.fields(model)
    ops, args = bytearray(), []
    for f in fields:
        t, op = f.type, 0
        if t[0] == "union":
            op = 0x10 if t[1][0] == "null" else 0x20
            t = t[2] if t[1][0] == "null" else t[1]
        op |= _NATIVE_OPS[t[0]]
        ops.append(op)
        if t[0] == "string":
            args.append(f.cap)
        elif t[0] == "enum":
            members, _, _ = _enum_tables(f.enum, t[2], f.where)
            index: dict = {}
            for i, member in enumerate(members):
                index.setdefault(member, i)
            args.append((members, index))
        elif t[0] == "map":
            entries, _, max_bytes = f.map_caps
            args.append((entries, max_bytes))
        else:
            args.append(None)
    position = {f.name: i for i, f in enumerate(fields)}
    slots, sources = [], []
    for mf in model_fields:
        slots.append(sys.intern(mf.name))
        if mf.name in position:
            sources.append(position[mf.name])
        elif mf.default is not dataclasses.MISSING:
            sources.append((mf.default,))
        elif mf.default_factory is not dataclasses.MISSING:
            sources.append(mf.default_factory)
        else:
            return None
    names = tuple(sys.intern(f.name) for f in fields)
    field_slots = tuple(slots.index(f.name) for f in fields)
    return (bytes(ops), tuple(args), names, model, object.__new__, tuple(slots), tuple(sources), field_slots)


def compile_codec(
    parsed: Mapping[str, Any],
    binding: ModelBinding,
    caps: FieldCaps,
    *,
    late_check: LateCheck | None = None,
    source: str = "",
) -> FastCodec:
    """Generate and compile the codec of one parsed record schema for ``binding.model``.

    ``late_check(obj)`` reports the cap/range problem of a decoded object, if any (the
    codec passes its own check so the messages match the fastavro path); without one,
    or if it misses a problem the decoder saw, a generic check names it. ``source``
    names the schema in messages. Raises :class:`UnsupportedSchema` if the schema or
    its fit to the model is not supported.
    """
    record = str(parsed.get("name", "record")).rsplit(".", 1)[-1]
    fields = _fields(parsed, binding, caps, record)
    generic = _default_late_check(binding, fields, record)

    def check_late(obj: Any, flagged: int) -> None:
        # ``flagged``: a problem was seen while decoding, so one must be reported.
        # Otherwise the body was merely long enough that a string might exceed a cap.
        problem = late_check(obj) if late_check is not None else generic(obj)
        if problem is None and flagged:
            problem = generic(obj) or ("invalid_field", f"{record}: a field is out of range")
        if problem is not None:
            raise DecodeError(*problem)

    # No string can exceed its cap in a body no longer than the smallest cap.
    string_caps = [f.cap for f in fields if f.cap is not None]
    string_caps += [f.map_caps[2] for f in fields if f.map_caps is not None]
    min_cap = min(string_caps) if string_caps else None

    cont14, last14 = _varint_tables()
    helpers = {
        "DecodeError": DecodeError,
        "_varint": _varint,
        "_uvarint": _uvarint,
        "_SHORT_LENGTH": _SHORT_LENGTH,
        "_BOOLEAN": _BOOLEAN,
        "_new": object.__new__,
        "_int": _int,
        "_length": _length,
        "_index": _index,
        "_bad_boolean": _bad_boolean,
        "_map_of_strings": _map_of_strings,
        "_put_long": _put_long,
        "_put_map_of_strings": _put_map_of_strings,
        "_check_late": check_late,
        "_CONT14": cont14,
        "_LAST14": last14,
    }
    label = f"{record} ({source})" if source else record

    # -- decode ------------------------------------------------------------------------
    dec = _Source()
    dec.namespace.update(helpers)
    max_record = caps.max_record_bytes
    dec.line(0, "def decode(data, pos):")
    dec.line(1, "size = len(data)")
    dec.line(1, f"if size > {max_record}:")
    dec.line(2, f"raise DecodeError('too_large', f'{{size}} bytes exceed max_record_bytes={max_record}')")
    dec.line(1, "late = 0")
    dec.line(1, "start = pos")
    dec.line(1, "end = 0")
    dec.line(1, "try:")
    for f in fields:
        dec.line(2, f"# {f.name}: {f.type}")
        _decode_value(dec, f, f.type, f.var, 2)
    dec.line(1, "except IndexError:")
    dec.line(2, f"raise DecodeError('truncated', {('body ends early (' + label + ')')!r}) from None")
    dec.line(1, "except UnicodeDecodeError as exc:")
    dec.line(2, "if end > size:  # a string cut short by the end of the message")
    dec.line(3, f"raise DecodeError('truncated', {('body ends early (' + label + ')')!r}) from None")
    dec.line(2, "raise DecodeError('malformed', f'invalid UTF-8 in a string: {exc.reason}') from None")
    dec.line(1, "except DecodeError:")
    dec.line(2, "raise")
    dec.line(1, "except Exception as exc:  # a bug here must still come out as a DecodeError")
    dec.line(2, "raise DecodeError('malformed', f'{type(exc).__name__}: {exc}') from None")
    dec.line(1, "if pos != size:")
    dec.line(2, "if pos > size:  # the last string ran past the end")
    dec.line(3, f"raise DecodeError('truncated', {('body ends early (' + label + ')')!r})")
    dec.line(2, "raise DecodeError('malformed', f'{size - pos} trailing bytes after the record')")
    _construct(dec, binding, fields, 1)
    if min_cap is None:
        dec.line(1, "if late:")
    else:
        dec.line(1, f"if late or size - start > {min_cap}:")
    dec.line(2, "_check_late(obj, late)")
    dec.line(1, "return obj")
    decode_text = "\n".join(dec.lines) + "\n"

    # -- encode ------------------------------------------------------------------------
    enc = _Source()
    enc.namespace.update(helpers)
    enc.line(0, "def encode(obj, header):")
    enc.line(1, "out = bytearray(header)")
    enc.line(1, "try:")
    for f in fields:
        enc.line(2, f"# {f.name}: {f.type}")
        enc.line(2, f"v = obj.{f.name}")
        _encode_value(enc, f, f.type, "v", 2)
    enc.line(1, "except Exception:  # e.g. a lone surrogate in a string: the general path explains")
    enc.line(2, "return None")
    enc.line(1, f"if len(out) > {max_record}:")
    enc.line(2, "return None")
    enc.line(1, "return bytes(out)")
    encode_text = "\n".join(enc.lines) + "\n"

    _compile(decode_text, f"decode {record}", dec.namespace)
    _compile(encode_text, f"encode {record}", enc.namespace)
    decode, encode = dec.namespace["decode"], enc.namespace["encode"]
    program = _native_program(binding, fields) if native_available() else None
    if program is None:
        return FastCodec(record, decode, encode, decode_text, encode_text)
    # The C twin reads only bodies no longer than the smallest cap, where no string can be
    # over its cap, so it never has to name one.
    quick = max_record if min_cap is None else min(min_cap, max_record)
    # Filled slot by slot in C only if object.__new__ is all its construction would do.
    direct = binding.model.__new__ is object.__new__
    program += (quick, max_record, _native.slot_offsets(binding.model, program[5]) if direct else None)
    native_decode = functools.partial(_native.decode, program)
    native_encode = functools.partial(_native.encode, program)

    def decode_either(data, pos, _python=decode):
        # None: the C twin did not read it completely and canonically; the generated code
        # decides (and explains).
        obj = native_decode(data, pos)
        return obj if obj is not None else _python(data, pos)

    def encode_either(obj, header, _python=encode):
        data = native_encode(obj, header)
        return data if data is not None else _python(obj, header)

    return FastCodec(record, decode_either, encode_either, decode_text, encode_text,
                     python_decode=decode, native_decode=native_decode,
                     encode_values=functools.partial(_native.encode_values, program))
