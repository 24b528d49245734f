"""Encoding and decoding of requests, responses and streamed chunks, with fastavro.

Two wire formats, told apart by their first byte(s):

* **Avro single-object encoding** (the default): ``C3 01`` + the writer schema's
  CRC-64-AVRO fingerprint (8 bytes, little-endian) + the Avro binary body. The
  fingerprint must name a schema published in the :class:`SchemaStore`.
* **Confluent wire format**: ``00`` + 4-byte big-endian registry schema id + body,
  resolved through a :class:`~pipeline.serde.registry.RegistryFormat`.

Either way the body is decoded with the writer schema it was written with and resolved
to the store's current schema of that record, so producers and consumers on different
schema revisions interoperate.

Decoding is defensive: whatever the bytes, only :class:`DecodeError` (or its subclass
:class:`SchemaNotFoundError`) comes out, with a ``reason`` code:

``too_large``          more than ``max_record_bytes``; checked before anything else
``truncated``          the header or the body ends early (or a size in it claims more
                       than the message holds)
``bad_magic``          neither ``C3 01`` nor ``00`` in front
``unknown_fingerprint`` no published schema of this record has that fingerprint
``unknown_schema_id``  no registry configured, id unknown, or its schema unusable
``malformed``          bytes left after the body, invalid UTF-8, an over-long varint,
                       other body errors
``invalid_field``      enum/union index out of range, a boolean byte other than
                       ``00``/``01``, enum symbol unknown to the reader, ``int`` out of
                       32-bit range
``limit_exceeded``     a field over its :class:`SerdeLimits` cap (the message names it);
                       a :class:`LimitExceeded`, which for a request whose sender and
                       reply destination are readable carries the request (see
                       :meth:`Codec.decode_request`)

The one exception is a registry that cannot be reached while resolving an id not yet
cached: that raises a plain :class:`SerdeError`, since the message may well be fine.

Before fastavro reads a body, :class:`~pipeline.serde.body_check.BodyCheck` walks its
bytes along the writer schema: sizes, caps and the encoding rules fastavro does not
enforce, the same for every schema revision. Encoding runs that check over what it has
written (raising :class:`EncodeError`), so whatever this codec encodes, it also decodes.
Messages name schemas by name and revision, never by file path.

Chunks (``llm_chunk``) are optional in a schema directory: a codec over a store without
them (an older deployment's) encodes and decodes requests and responses as before, and
refuses chunks (:class:`EncodeError`; decoding, :class:`SchemaNotFoundError`).
"""

from __future__ import annotations

import dataclasses
import functools
from io import BytesIO
from typing import Any, Literal

from fastavro import schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError
from fastavro.validation import validate

from pipeline.errors import DecodeError, EncodeError, LimitExceeded, SchemaNotFoundError
from pipeline.models import Chunk, Request, Response
from pipeline.serde.body_check import BodyCheck
from pipeline.serde.limits import SerdeLimits
from pipeline.serde.registry import RegistryFormat
from pipeline.serde.schema_store import ReadPlan, SchemaLoadError, SchemaRevision, SchemaStore

__all__ = [
    "CHUNK_SCHEMA",
    "Codec",
    "REQUEST_SCHEMA",
    "RESPONSE_FIELDS",
    "RESPONSE_SCHEMA",
    "SINGLE_OBJECT_MAGIC",
    "Wire",
]

#: First two bytes of an Avro single-object encoded message.
SINGLE_OBJECT_MAGIC = b"\xc3\x01"
_SINGLE_OBJECT_HEADER_LEN = 10
_CONFLUENT_HEADER_LEN = 5

#: Schema-store names of the records.
REQUEST_SCHEMA = "llm_request"
RESPONSE_SCHEMA = "llm_response"
CHUNK_SCHEMA = "llm_chunk"

Wire = Literal["single-object", "confluent"]

#: The order of the values :meth:`Codec.encode_response_values` takes: Response's fields.
RESPONSE_FIELDS = tuple(f.name for f in dataclasses.fields(Response))


class _Sink(bytearray):
    """A growable buffer fastavro can ``write`` to; one per call, so thread-safe."""

    __slots__ = ()
    write = bytearray.extend


def _fields_of_kind(schema: dict, *kinds: str) -> tuple[tuple[str, bool], ...]:
    """Top-level fields that hold one of ``kinds``, alone or in a union: ``(name, whether
    None is a value of it too)``."""

    def holds(t: Any) -> bool:
        if isinstance(t, list):
            return any(holds(branch) for branch in t)
        if isinstance(t, dict):
            t = t.get("type")
        return t in kinds

    return tuple((f["name"], isinstance(f["type"], list) and "null" in f["type"])
                 for f in schema["fields"] if holds(f["type"]))


#: The request fields an answer to it carries or is routed by: a request with one of them over
#: its cap cannot be answered, whatever else it holds.
_ANSWER_FIELDS = ("request_id", "tenant_id", "reply_to", "trace_id")


class _Reader:
    """How one writer schema's bodies become records of the current schema of one name."""

    __slots__ = ("writer", "reader", "check", "label", "limits", "_lifted")

    def __init__(self, plan: ReadPlan, limits: SerdeLimits):
        self.writer = plan.writer
        self.reader = plan.reader
        self.label = plan.writer_source
        self.limits = limits
        self.check = BodyCheck(plan.writer, limits, self.label)
        self._lifted: BodyCheck | None = None

    def read(self, data: bytes, offset: int, check: BodyCheck | None = None) -> dict:
        """The body at ``data[offset:]``, checked (by ``check``, default the limits'), then read
        by fastavro."""
        (check or self.check).check(data, offset)
        stream = BytesIO(data)
        stream.seek(offset)
        try:
            rec = schemaless_reader(stream, self.writer, self.reader)
        except SchemaResolutionError as exc:
            raise DecodeError("invalid_field", f"cannot resolve to the reader schema: {exc}") from None
        except UnicodeDecodeError as exc:
            raise DecodeError("malformed", f"invalid UTF-8 in a string: {exc.reason} ({self.label})") from None
        except EOFError:  # the check lets through no short body; should fastavro disagree
            raise DecodeError("truncated", f"body ends early ({self.label})") from None
        except Exception as exc:
            raise DecodeError("malformed", f"{type(exc).__name__} reading the body ({self.label})") from None
        if stream.tell() != len(data) or type(rec) is not dict:
            raise DecodeError("malformed", f"the body does not read as one record ({self.label})")
        return rec

    def read_lifted(self, data: bytes, offset: int) -> dict:
        """:meth:`read` with no string or bytes cap but the message's own size. That costs no
        more than the message already did: its bytes are in memory, and a string must fit in
        them. The item and entry caps stay, since a block count is what could make fastavro
        build far more than the message holds."""
        if self._lifted is None:  # built on first need; a race builds it twice, harmlessly
            limits = self.limits
            most = limits.max_record_bytes
            lifted = dataclasses.replace(limits, max_prompt_bytes=max(most, limits.max_prompt_bytes),
                                         max_string_bytes=max(most, limits.max_string_bytes),
                                         max_output_bytes=max(most, limits.max_output_bytes))
            self._lifted = BodyCheck(self.writer, lifted, self.label)
        return self.read(data, offset, self._lifted)


class _Writer:
    """What encoding one record with its current revision needs."""

    __slots__ = ("rev", "header", "check", "integers", "booleans", "arrays", "kind")

    def __init__(self, rev: SchemaRevision, limits: SerdeLimits):
        self.rev = rev
        self.kind = rev.fullname.rsplit(".", 1)[-1]
        self.header = SINGLE_OBJECT_MAGIC + rev.fingerprint.le_bytes
        self.check = BodyCheck(rev.parsed, limits, rev.source)
        self.integers = _fields_of_kind(rev.parsed, "int", "long")
        self.booleans = _fields_of_kind(rev.parsed, "boolean")
        self.arrays = _fields_of_kind(rev.parsed, "array")


class Codec:
    """Encodes :class:`Request`/:class:`Response`/:class:`Chunk` to bytes and back.

    ``store`` supplies the writer schema (its current revisions) and every schema a
    single-object message may name; ``registry`` (optional) enables the Confluent
    wire format. Instances are thread-safe.
    """

    def __init__(self, store: SchemaStore, limits: SerdeLimits | None = None, registry: RegistryFormat | None = None):
        self.store = store
        self.limits = limits if limits is not None else SerdeLimits()
        self.registry = registry
        self._max_record_bytes = self.limits.max_record_bytes
        self._request = _Writer(store.current_revision(REQUEST_SCHEMA), self.limits)
        self._response = _Writer(store.current_revision(RESPONSE_SCHEMA), self.limits)
        self._chunk = (_Writer(store.current_revision(CHUNK_SCHEMA), self.limits)
                       if CHUNK_SCHEMA in store.names() else None)
        # (fingerprint bytes | schema id, store name) -> _Reader; only hits are cached.
        self._fp_readers: dict[tuple[bytes, str], _Reader] = {}
        self._id_readers: dict[tuple[int, str], _Reader] = {}
        writers = [(self._request, REQUEST_SCHEMA), (self._response, RESPONSE_SCHEMA)]
        if self._chunk is not None:
            writers.append((self._chunk, CHUNK_SCHEMA))
        for writer, name in writers:
            plan = store.read_plan(writer.rev, name)
            self._fp_readers[(writer.rev.fingerprint.le_bytes, name)] = _Reader(plan, self.limits)

    @classmethod
    def default(cls) -> Codec:
        """The shared codec over :meth:`SchemaStore.load` with default limits (cached)."""
        return _default_codec()

    # -- encoding --------------------------------------------------------------

    def encode_request(self, req: Request, wire: Wire = "single-object", topic: str | None = None) -> bytes:
        """Encode ``req`` with the current request schema.

        ``wire="confluent"`` frames it with the registry id registered for ``topic``
        (needs a ``registry``). Raises :class:`EncodeError`.
        """
        if not isinstance(req, Request):
            raise EncodeError(f"LLMRequest: encode_request needs a Request, got {type(req).__name__}")
        return self._encode(req, self._request, wire, topic)

    def encode_response(self, resp: Response, wire: Wire = "single-object", topic: str | None = None) -> bytes:
        """Encode ``resp`` with the current response schema (see :meth:`encode_request`)."""
        if not isinstance(resp, Response):
            raise EncodeError(f"LLMResponse: encode_response needs a Response, got {type(resp).__name__}")
        return self._encode(resp, self._response, wire, topic)

    def encode_response_values(self, values: tuple, wire: Wire = "single-object", topic: str | None = None) -> bytes:
        """Encode the response whose field values, in :data:`RESPONSE_FIELDS` order, are
        ``values``: the bytes of ``encode_response(Response(**dict(zip(RESPONSE_FIELDS, values))))``."""
        return self.encode_response(Response(**dict(zip(RESPONSE_FIELDS, values))), wire, topic)

    def encode_chunk(self, chunk: Chunk, wire: Wire = "single-object", topic: str | None = None) -> bytes:
        """Encode ``chunk`` with the current chunk schema (see :meth:`encode_request`); its
        ``delta`` is capped by ``max_output_bytes``."""
        if not isinstance(chunk, Chunk):
            raise EncodeError(f"LLMChunk: encode_chunk needs a Chunk, got {type(chunk).__name__}")
        if self._chunk is None:
            raise EncodeError("LLMChunk: the schema store has no llm_chunk schema (publish it as llm_chunk revision 1)")
        return self._encode(chunk, self._chunk, wire, topic)

    def _encode(self, obj: Request | Response | Chunk, writer: _Writer, wire: str, topic: str | None) -> bytes:
        what = f"cannot encode {writer.kind} {obj.request_id!r}"
        try:
            rec = obj.to_record()
        except AttributeError as exc:  # e.g. an enum field holding a plain string
            raise EncodeError(f"{what}: {exc}") from exc
        # fastavro writes True as 1 and truncates 1.5 to 1 in an int or long field, writes
        # anything truthy as true in a boolean one, and any iterable as an array: a string
        # as its characters (stop="END" as ["E", "N", "D"]), a dict as its keys.
        for name, nullable in writer.integers:
            value = rec.get(name)
            if type(value) is not int and (value is not None or not nullable):
                raise EncodeError(f"{what}: {writer.kind}.{name}: {value!r:.40} is not an int")
        for name, nullable in writer.booleans:
            value = rec.get(name)
            if type(value) is not bool and (value is not None or not nullable):
                raise EncodeError(f"{what}: {writer.kind}.{name}: {value!r:.40} is not a bool")
        for name, nullable in writer.arrays:
            value = rec.get(name)
            if type(value) is not list and type(value) is not tuple and (value is not None or not nullable):
                raise EncodeError(f"{what}: {writer.kind}.{name}: a {type(value).__name__} is not a list")
        header = writer.header if wire == "single-object" else self._registry_header(writer.rev, wire, topic)
        sink = _Sink(header)
        try:
            schemaless_writer(sink, writer.rev.parsed, rec)
        except Exception as exc:
            raise EncodeError(f"{what}: {self._explain(rec, writer.rev, exc)}") from exc
        if len(sink) > self._max_record_bytes:
            raise EncodeError(f"{what}: {len(sink)} bytes exceed max_record_bytes={self._max_record_bytes}")
        try:
            writer.check.check(sink, len(header))
        except DecodeError as exc:
            raise EncodeError(f"{what}: {exc.detail}") from None
        return bytes(sink)

    def _registry_header(self, rev: SchemaRevision, wire: str, topic: str | None) -> bytes:
        if wire != "confluent":
            raise EncodeError(f"{rev.fullname}: unknown wire format {wire!r} (use 'single-object' or 'confluent')")
        if self.registry is None:
            raise EncodeError(f"{rev.fullname}: the confluent wire format needs a schema registry")
        if not topic:
            raise EncodeError(f"{rev.fullname}: the confluent wire format needs a topic (for the subject name)")
        return self.registry.header(topic, rev)

    @staticmethod
    def _explain(rec: dict, rev: SchemaRevision, exc: Exception) -> str:
        # Only on the error path: fastavro's writer does not always name the field, its
        # validator does.
        try:
            validate(rec, rev.parsed, raise_errors=True)
        except Exception as detail:  # ValidationError and friends
            text = " ".join(str(detail).split())
            if text:
                return text
        return f"{type(exc).__name__}: {exc}"

    # -- decoding --------------------------------------------------------------

    def decode_request(self, data: bytes) -> Request:
        """Decode a request in either wire format. Raises :class:`DecodeError`.

        A string or bytes value over its cap raises :class:`LimitExceeded` whose ``request``
        is the request read with those caps lifted (:meth:`_Reader.read_lifted`), provided it
        reads that way and what an answer carries or is routed by (id, tenant, reply topic,
        trace id) is within its own caps: then it can be answered, REJECTED with the
        exception's ``refusal``, where any answer of it would go, instead of being
        dead-lettered. Over any other cap (items, entries, ``max_record_bytes``) nothing is read.
        """
        data, reader, offset = self._frame(data, REQUEST_SCHEMA)
        try:
            rec = reader.read(data, offset)
        except LimitExceeded as exc:
            if exc.unit == "bytes":
                exc.request = self._request_over_limit(data, reader, offset)
            raise
        try:
            return Request.from_record(rec)
        except (KeyError, ValueError, TypeError) as exc:
            raise DecodeError("invalid_field", f"LLMRequest: {exc}") from None

    def _request_over_limit(self, data: bytes, reader: _Reader, offset: int) -> Request | None:
        try:
            req = Request.from_record(reader.read_lifted(data, offset))
        except (DecodeError, KeyError, ValueError, TypeError):
            return None
        for name in _ANSWER_FIELDS:
            value = getattr(req, name)
            if value is not None and len(value.encode("utf-8")) > self.limits.string_cap(self._request.kind, name)[0]:
                return None
        return req

    def decode_response(self, data: bytes) -> Response:
        """Decode a response in either wire format. Raises :class:`DecodeError`."""
        data, reader, offset = self._frame(data, RESPONSE_SCHEMA)
        rec = reader.read(data, offset)
        try:
            return Response.from_record(rec)
        except (KeyError, ValueError, TypeError) as exc:
            raise DecodeError("invalid_field", f"LLMResponse: {exc}") from None

    def decode_chunk(self, data: bytes) -> Chunk:
        """Decode a chunk in either wire format. Raises :class:`DecodeError`."""
        data, reader, offset = self._frame(data, CHUNK_SCHEMA)
        rec = reader.read(data, offset)
        try:
            return Chunk.from_record(rec)
        except (KeyError, ValueError, TypeError) as exc:
            raise DecodeError("invalid_field", f"LLMChunk: {exc}") from None

    @staticmethod
    def wire_format(data: bytes) -> str:
        """``"single-object"``, ``"confluent"`` or ``"unknown"``, from the first byte(s)."""
        if data[:2] == SINGLE_OBJECT_MAGIC:
            return "single-object"
        if data[:1] == b"\x00":
            return "confluent"
        return "unknown"

    def _frame(self, data: Any, name: str) -> tuple[bytes, _Reader, int]:
        """Check size and header: ``(data as bytes, its reader, offset of the body)``."""
        if type(data) is not bytes:
            if isinstance(data, (bytes, bytearray, memoryview)):
                data = bytes(data)
            else:
                raise DecodeError("malformed", f"expected bytes, got {type(data).__name__}")
        size = len(data)
        if size > self._max_record_bytes:
            raise DecodeError("too_large", f"{size} bytes exceed max_record_bytes={self._max_record_bytes}")
        if size == 0:
            raise DecodeError("truncated", "empty message")
        first = data[0]
        if first == 0xC3:
            if size >= 2 and data[1] != 0x01:
                raise DecodeError("bad_magic", f"message starts with {data[:2].hex()}, not c301 or 00")
            if size < _SINGLE_OBJECT_HEADER_LEN:
                raise DecodeError("truncated", f"single-object header needs 10 bytes, got {size}")
            fp = data[2:10]
            reader = self._fp_readers.get((fp, name))
            if reader is None:
                reader = self._reader_for_fingerprint(fp, name)
            return data, reader, _SINGLE_OBJECT_HEADER_LEN
        if first == 0:
            if size < _CONFLUENT_HEADER_LEN:
                raise DecodeError("truncated", f"confluent header needs 5 bytes, got {size}")
            schema_id = int.from_bytes(data[1:5], "big")
            reader = self._id_readers.get((schema_id, name))
            if reader is None:
                reader = self._reader_for_schema_id(schema_id, name)
            return data, reader, _CONFLUENT_HEADER_LEN
        raise DecodeError("bad_magic", f"message starts with {data[:2].hex()}, not c301 or 00")

    def _current(self, name: str, reason: str) -> SchemaRevision:
        try:
            return self.store.current_revision(name)
        except KeyError:  # a store without chunks: nothing of that record can be read
            raise SchemaNotFoundError(reason, f"no {name} schema is published here") from None

    def _reader_for_fingerprint(self, fp: bytes, name: str) -> _Reader:
        writer = self.store.writer_for_fingerprint(fp)
        current = self._current(name, "unknown_fingerprint")
        if writer is None:
            raise SchemaNotFoundError("unknown_fingerprint", f"no published schema has fingerprint {fp.hex()}")
        if writer.fullname != current.fullname:
            raise SchemaNotFoundError(
                "unknown_fingerprint",
                f"fingerprint {fp.hex()} is {writer.source} ({writer.fullname}), not {current.fullname}",
            )
        # Published schemas passed the store's checks, so BodyCheck takes them all.
        return self._fp_readers.setdefault((fp, name), _Reader(self.store.read_plan(writer, name), self.limits))

    def _reader_for_schema_id(self, schema_id: int, name: str) -> _Reader:
        if self.registry is None:
            raise SchemaNotFoundError(
                "unknown_schema_id", f"schema id {schema_id}: no schema registry configured for the confluent wire format"
            )
        writer = self.registry.writer_for_id(schema_id)  # SchemaNotFoundError / SerdeError
        current = self._current(name, "unknown_schema_id")
        if writer.fullname != current.fullname:
            raise SchemaNotFoundError(
                "unknown_schema_id", f"schema id {schema_id} is {writer.fullname}, not {current.fullname}"
            )
        try:
            reader = _Reader(self.store.read_plan(writer, name), self.limits)
        except SchemaLoadError as exc:
            raise SchemaNotFoundError("unknown_schema_id", f"schema id {schema_id} is unusable: {exc}") from None
        return self._id_readers.setdefault((schema_id, name), reader)


@functools.lru_cache(maxsize=1)
def _default_codec() -> Codec:
    return Codec(SchemaStore.load(), SerdeLimits())
