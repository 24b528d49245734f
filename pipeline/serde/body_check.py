"""What an Avro body may claim, checked on its bytes before fastavro reads it.

fastavro believes a body: it reads as many entries as a block count claims, a negative
enum or union index from the end of its list, any non-zero boolean byte as ``true``,
and an over-long varint wrapped around. So every body the codec decodes is first walked
here along its writer schema, without building a single value, and refused with a
:class:`~pipeline.errors.DecodeError` reason unless:

* every size it declares fits in what is left of the message: a string, bytes or fixed
  value, a float or double, and the items a map or array block claims (each takes at
  least one byte, a rule :mod:`pipeline.serde.schema_store` enforces on every schema).
  Otherwise ``truncated``, as for a body cut short; so whatever fastavro then builds is
  bounded by the message, which the codec caps at ``max_record_bytes`` beforehand;
* every string (and bytes value) is within its :class:`~pipeline.serde.limits.SerdeLimits`
  cap (looked up by where it sits, :meth:`~pipeline.serde.limits.SerdeLimits.cap_at`),
  every map within ``max_metadata_entries`` and every array within its item cap
  (:meth:`~pipeline.serde.limits.SerdeLimits.items_cap_at`), counting encoded entries
  and items (duplicate keys too, across blocks), or ``limit_exceeded``: refused before
  fastavro builds the value, with a :class:`~pipeline.errors.LimitExceeded` that says which
  field, how big and which cap (so a request over a string cap can still be answered);
* it keeps to the encoding rules fastavro does not check: a boolean byte is ``00`` or
  ``01``, an enum or union index is within its list, an ``int`` fits in 32 bits
  (``invalid_field``); no varint is longer than 10 bytes or beyond 64 bits, and a
  block's declared byte size is its size, since fastavro skips the fields a reader
  schema lacks by that size and the walk must cover the bytes fastavro reads
  (``malformed``); nothing follows the record (``malformed``).

Valid encodings no llmq writer produces (negative block counts with their byte size,
several blocks, varints longer than needed within 10 bytes, an ``int`` among them)
pass, as fastavro reads them. UTF-8 validity is left to
fastavro. The codec runs the same walk over every body it encodes, so it never writes
what it would refuse to read.
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import DecodeError, LimitExceeded
from pipeline.serde.limits import SerdeLimits
from pipeline.serde.schema_store import SchemaLoadError

__all__ = ["BodyCheck"]

_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1

# Node kinds; a node is a tuple (kind, where, ...) built once per writer schema.
_NULL, _BOOLEAN, _INT, _LONG, _FIXED, _STRING, _ENUM, _UNION, _ARRAY, _MAP, _RECORD = range(11)

# Longest map key shown in a message: keys are the sender's text, and messages travel
# into dead-letter headers.
_KEY_SHOWN = 40


def _varint(data, pos: int, where: str) -> tuple[int, int]:
    """The zig-zag varint (an Avro long) at ``data[pos]``: ``(value, next position)``.

    ``IndexError`` if the data ends inside it.
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
                raise DecodeError("malformed", f"{where}: the varint at byte {start} {what}")
            n |= b << 63
            break
        n |= (b & 0x7F) << shift
        shift += 7
    return (n >> 1) ^ -(n & 1), pos


def _int(data, pos: int, where: str) -> tuple[int, int]:
    """An Avro ``int`` (a field value, enum or union index): within 32 bits."""
    b = data[pos]
    if b < 0x80:
        return (b >> 1) ^ -(b & 1), pos + 1
    value, end = _varint(data, pos, where)
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise DecodeError("invalid_field", f"{where}: {value} is not a 32-bit int")
    return value, end


def _length(data, pos: int, end: int, where: str) -> tuple[int, int]:
    """A string/bytes length that fits in what is left: ``(length, position of the bytes)``."""
    b = data[pos]
    if b < 0x80:
        n = (b >> 1) ^ -(b & 1)
        pos += 1
    else:
        n, pos = _varint(data, pos, where)
    if n < 0:
        # What fastavro reports for it, too (it tries to read -n bytes and gets fewer).
        raise DecodeError("truncated", f"{where}: negative length {n}")
    if n > end - pos:
        raise DecodeError("truncated", f"{where}: {n} bytes claimed, {end - pos} left")
    return n, pos


def _block_count(data, pos: int, end: int, where: str, item_min: int) -> tuple[int, int, int]:
    """A map/array block header: ``(item count, declared byte size or -1, position)``."""
    count, pos = _varint(data, pos, where)
    size = -1
    if count < 0:
        count = -count
        size, pos = _varint(data, pos, where)
        if size < 0:
            raise DecodeError("malformed", f"{where}: negative block byte size {size}")
    if count * item_min > end - pos:
        raise DecodeError(
            "truncated", f"{where}: a block of {count} items cannot fit in the {end - pos} bytes left"
        )
    return count, size, pos


def _block_end(size: int, start: int, pos: int, where: str) -> None:
    if size >= 0 and pos - start != size:
        raise DecodeError("malformed", f"{where}: a block declared as {size} bytes takes {pos - start}")


def _walk(nodes: tuple, data, pos: int, end: int) -> int:
    """Check the values of ``nodes``, one after the other, from ``data[pos]``; returns the
    position after the last.

    One-byte varints (short strings, small numbers, enum and union indexes) are read
    inline: they are nearly every value of an ordinary message.
    """
    for node in nodes:
        try:
            while True:  # once, or again with the branch a union holds
                kind = node[0]
                if kind == _STRING:
                    b = data[pos]
                    if b < 0x80 and not b & 1:
                        n = b >> 1
                        pos += 1
                        if n > end - pos:
                            raise DecodeError("truncated", f"{node[1]}: {n} bytes claimed, {end - pos} left")
                    else:
                        n, pos = _length(data, pos, end, node[1])
                    if n > node[2]:
                        raise LimitExceeded(f"{node[1]}: {n} bytes exceed {node[3]}={node[2]}", field=node[1],
                                            size=n, unit="bytes", cap=node[2], limit=node[3])
                    pos += n
                elif kind == _LONG:
                    if data[pos] < 0x80:
                        pos += 1
                    else:
                        pos = _varint(data, pos, node[1])[1]
                elif kind == _UNION:
                    b = data[pos]
                    branches = node[2]
                    if b < 0x80 and not b & 1 and b >> 1 < len(branches):
                        index = b >> 1
                        pos += 1
                    else:
                        index, pos = _int(data, pos, node[1])
                        if not 0 <= index < len(branches):
                            raise DecodeError(
                                "invalid_field", f"{node[1]}: union index {index} is outside 0..{len(branches) - 1}"
                            )
                    node = branches[index]
                    if node[0] != _NULL:
                        continue
                elif kind == _BOOLEAN:
                    b = data[pos]
                    if b > 1:
                        raise DecodeError(
                            "invalid_field", f"{node[1]}: boolean byte {b:02x} (only 00 and 01 are booleans)"
                        )
                    pos += 1
                elif kind == _INT:
                    if data[pos] < 0x80:
                        pos += 1
                    else:
                        pos = _int(data, pos, node[1])[1]
                elif kind == _ENUM:
                    b = data[pos]
                    if b < 0x80 and not b & 1 and b >> 1 < node[2]:
                        pos += 1
                    else:
                        index, pos = _int(data, pos, node[1])
                        if not 0 <= index < node[2]:
                            raise DecodeError(
                                "invalid_field", f"{node[1]}: enum index {index} is outside 0..{node[2] - 1}"
                            )
                elif kind == _MAP:
                    pos = _walk_map(node, data, pos, end)
                elif kind == _RECORD:
                    pos = _walk(node[2], data, pos, end)
                elif kind == _ARRAY:
                    pos = _walk_array(node, data, pos, end)
                elif kind == _FIXED:
                    if node[2] > end - pos:
                        raise DecodeError("truncated", f"{node[1]}: {node[2]} bytes needed, {end - pos} left")
                    pos += node[2]
                break  # _NULL has nothing to check
        except IndexError:
            raise DecodeError("truncated", f"the body ends inside {node[1]}") from None
    return pos


def _walk_array(node: tuple, data, pos: int, end: int) -> int:
    _, where, items, item_min, max_items, cap_name = node
    total = 0
    while True:
        count, size, pos = _block_count(data, pos, end, where, item_min)
        if not count:
            return pos
        total += count
        if total > max_items:
            raise LimitExceeded(f"{where}: {total} items exceed {cap_name}={max_items}", field=where, size=total,
                                unit="items", cap=max_items, limit=cap_name)
        start = pos
        for _ in range(count):
            pos = _walk(items, data, pos, end)
        _block_end(size, start, pos, where)


def _walk_map(node: tuple, data, pos: int, end: int) -> int:
    _, where, values, entry_min, max_entries, key_cap = node
    value = values[0]
    total = 0
    while True:
        count, size, pos = _block_count(data, pos, end, where, entry_min)
        if not count:
            return pos
        total += count
        if total > max_entries:
            raise LimitExceeded(f"{where}: {total} entries exceed max_metadata_entries={max_entries}", field=where,
                                size=total, unit="entries", cap=max_entries, limit="max_metadata_entries")
        start = pos
        for _ in range(count):
            b = data[pos]
            if b < 0x80 and not b & 1 and b >> 1 <= end - pos - 1:
                n = b >> 1
                pos += 1
            else:
                n, pos = _length(data, pos, end, where)
            if n > key_cap:
                raise LimitExceeded(f"{where}: a key of {n} bytes exceeds max_string_bytes={key_cap}",
                                    field=f"{where} key", size=n, unit="bytes", cap=key_cap, limit="max_string_bytes")
            key_at = pos
            pos += n
            if value[0] == _STRING:
                b = data[pos]
                if b < 0x80 and not b & 1 and b >> 1 <= end - pos - 1:
                    m = b >> 1
                    pos += 1
                else:
                    m, pos = _length(data, pos, end, where)
                if m > value[2]:
                    key = bytes(data[key_at:key_at + min(n, 4 * _KEY_SHOWN)]).decode("utf-8", "replace")
                    raise LimitExceeded(f"{where}[{key[:_KEY_SHOWN]!r}]: {m} bytes exceed {value[3]}={value[2]}",
                                        field=f"{where} value", size=m, unit="bytes", cap=value[2], limit=value[3])
                pos += m
            else:
                pos = _walk(values, data, pos, end)
        _block_end(size, start, pos, where)


class _Compiler:
    """Turns a fastavro-parsed schema into the nodes :func:`_walk` follows."""

    def __init__(self, limits: SerdeLimits, label: str):
        self.limits = limits
        self.label = label
        self.named: dict[str, tuple[tuple | None, int]] = {}  # fullname -> (node, minimum bytes)

    def node(self, schema: Any, where: str, cap: tuple[int, str] | None = None) -> tuple[tuple, int]:
        """``(node, minimum encoded bytes)``; ``cap`` applies to a string at this place, else
        the limits' cap for ``where``."""
        if isinstance(schema, list):
            branches = tuple(self.node(branch, where, cap)[0] for branch in schema)
            return (_UNION, where, branches), 1
        if isinstance(schema, dict):
            kind = schema["type"]
            if kind in ("record", "error"):
                return self.record(schema, where)
            if kind == "enum":
                return self.define(schema["name"], (_ENUM, where, len(schema["symbols"])), 1)
            if kind == "fixed":
                size = int(schema["size"])
                return self.define(schema["name"], (_FIXED, where, size), size)
            if kind == "array":
                items, item_min = self.node(schema["items"], f"{where}[]")
                if item_min < 1:
                    raise SchemaLoadError(f"{self.label}: {where}: array items can be encoded in zero bytes")
                return (_ARRAY, where, (items,), item_min) + self.limits.items_cap_at(where), 1
            if kind == "map":
                values, value_min = self.node(schema["values"], f"{where}{{}}")
                limits = self.limits
                entries = (values,), 1 + value_min, limits.max_metadata_entries, limits.max_string_bytes
                return (_MAP, where) + entries, 1
            return self.node(kind, where, cap)  # {"type": "string"} and the like
        if schema in ("string", "bytes"):
            limit, name = cap if cap is not None else self.limits.cap_at(where)
            return (_STRING, where, limit, name), 1
        if schema in ("long", "int", "boolean"):
            return ({"long": _LONG, "int": _INT, "boolean": _BOOLEAN}[schema], where), 1
        if schema == "null":
            return (_NULL, where), 0
        if schema in ("float", "double"):
            size = 4 if schema == "float" else 8
            return (_FIXED, where, size), size
        known = self.named.get(schema)
        if known is None or known[0] is None:
            raise SchemaLoadError(f"{self.label}: {where}: unknown or recursive type {schema!r}")
        node, size = known
        return (node[0], where) + node[2:], size

    def define(self, name: str, node: tuple, size: int) -> tuple[tuple, int]:
        self.named[name] = (node, size)
        return node, size

    def record(self, schema: dict, where: str) -> tuple[tuple, int]:
        name = schema["name"]
        self.named[name] = (None, 0)  # being compiled: a reference to it now is recursion
        fields, total = [], 0
        for f in schema.get("fields", ()):
            node, size = self.node(f["type"], f"{where}.{f['name']}")
            fields.append(node)
            total += size
        return self.define(name, (_RECORD, where, tuple(fields)), total)


class BodyCheck:
    """The checks of one writer schema's bodies, under one codec's limits.

    ``schema`` is fastavro-parsed (fully qualified names); ``label`` names it in errors
    (name and revision, never a file). String caps come from
    :meth:`SerdeLimits.cap_at` by where a string sits (``LLMRequest.prompt``,
    ``LLMRequest.messages[].content``), item caps from :meth:`SerdeLimits.items_cap_at`.
    """

    __slots__ = ("fields", "label")

    def __init__(self, schema: dict, limits: SerdeLimits, label: str):
        self.label = label
        record = schema["name"].rsplit(".", 1)[-1]
        compiler = _Compiler(limits, label)
        compiler.named[schema["name"]] = (None, 0)
        fields = []
        try:
            for f in schema["fields"]:
                fields.append(compiler.node(f["type"], f"{record}.{f['name']}")[0])
        except (KeyError, TypeError, ValueError) as exc:  # not what fastavro's parser produces
            raise SchemaLoadError(f"{label}: cannot check this schema: {type(exc).__name__}: {exc}") from None
        self.fields = tuple(fields)

    def check(self, data, offset: int) -> None:
        """Raise :class:`DecodeError` unless the body ``data[offset:]`` passes (see the module)."""
        end = len(data)
        pos = _walk(self.fields, data, offset, end)
        if pos != end:
            raise DecodeError("malformed", f"{end - pos} trailing bytes after the record ({self.label})")
