"""Encoding and decoding of requests and responses.

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
``truncated``          the header or the body ends early
``bad_magic``          neither ``C3 01`` nor ``00`` in front
``unknown_fingerprint`` no published schema of this record has that fingerprint
``unknown_schema_id``  no registry configured, id unknown, or its schema unusable
``malformed``          bytes left after the body, invalid UTF-8, other body errors
``invalid_field``      enum/union index out of range, enum symbol unknown to the
                       reader, ``int`` field out of 32-bit range
``limit_exceeded``     a field over its :class:`SerdeLimits` cap (the message names it)

The one exception is a registry that cannot be reached while resolving an id not yet
cached: that raises a plain :class:`SerdeError`, since the message may well be fine.

Messages written with the current schema revision (the hot path of every worker) are
encoded and decoded by code generated for that schema at load time
(:mod:`pipeline.serde.fastpath`), straight to and from the model objects. It gives the
same results and reasons as fastavro, but refuses what fastavro lets through: a
negative enum or union branch index (fastavro reads it Python-style from the end of
the list: ``01`` as a ``Priority`` reads as ``BACKGROUND``), a boolean byte other than
``00``/``01`` (fastavro: any non-zero byte is ``true``) and over-long varints (fastavro
wraps them around); see that module for the details. Messages written with other
revisions are read by fastavro, with those leniencies, as is everything when the codec
is built with ``fast=False``.

Encoding applies the same field caps (raising :class:`EncodeError`), so whatever this
codec encodes, it also decodes.
"""

from __future__ import annotations

import dataclasses
import functools
from io import BytesIO
from typing import Any, Literal

from fastavro import schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError
from fastavro.validation import validate

from pipeline.errors import DecodeError, EncodeError, SchemaNotFoundError
from pipeline.models import Request, Response
from pipeline.serde import fastpath
from pipeline.serde.limits import SerdeLimits
from pipeline.serde.registry import RegistryFormat
from pipeline.serde.schema_store import ReadPlan, SchemaRevision, SchemaStore

__all__ = [
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

#: Schema-store names of the two records.
REQUEST_SCHEMA = "llm_request"
RESPONSE_SCHEMA = "llm_response"

Wire = Literal["single-object", "confluent"]

#: The order of the values :meth:`Codec.encode_response_values` takes: Response's fields.
RESPONSE_FIELDS = tuple(f.name for f in dataclasses.fields(Response))

_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1

# Fields of each record by the cap that applies to them (besides metadata).
_REQUEST_STRINGS = ("request_id", "tenant_id", "model")
_REQUEST_OPTIONAL_STRINGS = ("user_tier", "trace_id", "degraded_from")
_REQUEST_INTS = ("max_tokens",)
_REQUEST_LONGS = ("created_at", "timeout_ms")
_REQUEST_OPTIONAL_LONGS = ("admitted_at",)
_RESPONSE_STRINGS = ("request_id", "tenant_id")
_RESPONSE_OPTIONAL_STRINGS = ("reason", "model", "worker_id")
_RESPONSE_INTS = ("prompt_tokens", "completion_tokens")
_RESPONSE_LONGS = ("created_at", "finished_at")
_RESPONSE_OPTIONAL_LONGS = ("admitted_at", "started_at", "retry_after_ms", "queue_position", "eta_ms")


_NO_METADATA: dict = {}


class _Sink(bytearray):
    """A growable buffer fastavro can ``write`` to; one per call, so thread-safe."""

    __slots__ = ()
    write = bytearray.extend


def _over(text: str, cap: int) -> int:
    """UTF-8 size of ``text`` if it exceeds ``cap`` bytes, else 0 (cheap when short)."""
    n = len(text)
    if n * 4 <= cap:  # even all 4-byte characters would fit
        return 0
    if n > cap:  # at least one byte per character
        return len(text.encode("utf-8", "surrogatepass"))
    size = len(text.encode("utf-8", "surrogatepass"))
    return size if size > cap else 0


def _request_fast_ok(rec: dict, quick: int, big_quick: int, max_entries: int, strict: bool) -> bool:
    """True if ``rec`` (an LLMRequest record) is certainly within all caps.

    Compares character counts against a quarter of each byte cap (a character takes at
    most 4 UTF-8 bytes), so no string is encoded; ``False`` means "look closer".
    """
    # Fields with a default may be missing when the reader schema is an older
    # revision; required ones are always there.
    user_tier = rec.get("user_tier")
    trace_id = rec.get("trace_id")
    degraded_from = rec.get("degraded_from")
    metadata = rec.get("metadata", _NO_METADATA)
    max_tokens = rec["max_tokens"]
    if (
        len(rec["prompt"]) > big_quick
        or len(rec["request_id"]) > quick
        or len(rec["tenant_id"]) > quick
        or len(rec["model"]) > quick
        or (user_tier is not None and len(user_tier) > quick)
        or (trace_id is not None and len(trace_id) > quick)
        or (degraded_from is not None and len(degraded_from) > quick)
        or len(metadata) > max_entries
        or not _INT32_MIN <= max_tokens <= _INT32_MAX
    ):
        return False
    if strict:
        admitted_at = rec.get("admitted_at")
        if (
            type(max_tokens) is not int
            or type(rec["created_at"]) is not int
            or type(rec["timeout_ms"]) is not int
            or (admitted_at is not None and type(admitted_at) is not int)
        ):
            return False
    for key, value in metadata.items():
        if len(key) > quick or len(value) > quick:
            return False
    return True


def _response_fast_ok(rec: dict, quick: int, big_quick: int, max_entries: int, strict: bool) -> bool:
    """True if ``rec`` (an LLMResponse record) is certainly within all caps."""
    output = rec.get("output")
    reason = rec.get("reason")
    model = rec.get("model")
    worker_id = rec.get("worker_id")
    metadata = rec.get("metadata", _NO_METADATA)
    prompt_tokens = rec.get("prompt_tokens", 0)
    completion_tokens = rec.get("completion_tokens", 0)
    if (
        (output is not None and len(output) > big_quick)
        or len(rec["request_id"]) > quick
        or len(rec["tenant_id"]) > quick
        or (reason is not None and len(reason) > quick)
        or (model is not None and len(model) > quick)
        or (worker_id is not None and len(worker_id) > quick)
        or len(metadata) > max_entries
        or not _INT32_MIN <= prompt_tokens <= _INT32_MAX
        or not _INT32_MIN <= completion_tokens <= _INT32_MAX
    ):
        return False
    if strict:
        if (
            type(prompt_tokens) is not int
            or type(completion_tokens) is not int
            or type(rec["created_at"]) is not int
            or type(rec["finished_at"]) is not int
        ):
            return False
        for name in _RESPONSE_OPTIONAL_LONGS:
            value = rec.get(name)
            if value is not None and type(value) is not int:
                return False
    for key, value in metadata.items():
        if len(key) > quick or len(value) > quick:
            return False
    return True


class _Check:
    """Field caps and integer ranges for one record kind.

    ``problem(rec, strict_ints)`` returns ``None`` or ``(reason, detail)``. A cheap
    conservative test (``fast``) clears ordinary records; only records it cannot
    clear get the exact, field-naming check. With ``strict_ints`` (encoding) integer
    fields must also be real ``int``s: fastavro would silently write ``True`` as 1 and
    truncate ``1.5`` to 1.
    """

    __slots__ = ("record", "strings", "optional_strings", "big_field", "big_cap", "big_limit",
                 "ints", "longs", "optional_longs", "limits", "fast", "quick", "big_quick")

    def __init__(self, record: str, limits: SerdeLimits, *, fast, strings, optional_strings, big_field,
                 big_cap, big_limit, ints, longs, optional_longs):
        self.record = record
        self.limits = limits
        self.fast = fast
        self.quick = limits.max_string_bytes // 4
        self.big_quick = big_cap // 4
        self.strings = strings
        self.optional_strings = optional_strings
        self.big_field = big_field
        self.big_cap = big_cap
        self.big_limit = big_limit
        self.ints = ints
        self.longs = longs
        self.optional_longs = optional_longs

    def problem(self, rec: dict, strict_ints: bool) -> tuple[str, str] | None:
        limits = self.limits
        if self.fast(rec, self.quick, self.big_quick, limits.max_metadata_entries, strict_ints):
            return None
        cap = limits.max_string_bytes
        for name in self.strings:
            size = _over(rec[name], cap)
            if size:
                return "limit_exceeded", f"{self.record}.{name}: {size} bytes exceed max_string_bytes={cap}"
        for name in self.optional_strings:
            value = rec.get(name)
            if value is not None:
                size = _over(value, cap)
                if size:
                    return "limit_exceeded", f"{self.record}.{name}: {size} bytes exceed max_string_bytes={cap}"
        big = rec.get(self.big_field)
        if big is not None:
            size = _over(big, self.big_cap)
            if size:
                return "limit_exceeded", (
                    f"{self.record}.{self.big_field}: {size} bytes exceed {self.big_limit}={self.big_cap}"
                )
        metadata = rec.get("metadata", _NO_METADATA)
        if len(metadata) > limits.max_metadata_entries:
            return "limit_exceeded", (
                f"{self.record}.metadata: {len(metadata)} entries exceed "
                f"max_metadata_entries={limits.max_metadata_entries}"
            )
        for key, value in metadata.items():
            size = _over(key, cap)
            if size:
                return "limit_exceeded", f"{self.record}.metadata: a key of {size} bytes exceeds max_string_bytes={cap}"
            size = _over(value, cap)
            if size:
                return "limit_exceeded", (
                    f"{self.record}.metadata[{key!r}]: {size} bytes exceed max_string_bytes={cap}"
                )
        for name in self.ints:
            value = rec.get(name, 0)
            if (strict_ints and type(value) is not int) or not _INT32_MIN <= value <= _INT32_MAX:
                return "invalid_field", f"{self.record}.{name}: {value!r} is not a 32-bit int"
        if strict_ints:
            for name in self.longs:
                value = rec[name]
                if type(value) is not int or not _INT64_MIN <= value <= _INT64_MAX:
                    return "invalid_field", f"{self.record}.{name}: {value!r} is not a 64-bit int"
            for name in self.optional_longs:
                value = rec.get(name)
                if value is not None and (type(value) is not int or not _INT64_MIN <= value <= _INT64_MAX):
                    return "invalid_field", f"{self.record}.{name}: {value!r} is not a 64-bit int or None"
        return None


class Codec:
    """Encodes :class:`Request`/:class:`Response` to bytes and back.

    ``store`` supplies the writer schema (its current revisions) and every schema a
    single-object message may name; ``registry`` (optional) enables the Confluent
    wire format. ``fast=False`` does everything with fastavro instead of the generated
    code (for comparisons; :attr:`fast` tells whether the generated code is in use, as
    it is not for schemas it does not support). Instances are thread-safe.
    """

    def __init__(
        self,
        store: SchemaStore,
        limits: SerdeLimits | None = None,
        registry: RegistryFormat | None = None,
        *,
        fast: bool = True,
    ):
        self.store = store
        self.limits = limits if limits is not None else SerdeLimits()
        self.registry = registry
        self._max_record_bytes = self.limits.max_record_bytes
        self._request_rev = store.current_revision(REQUEST_SCHEMA)
        self._response_rev = store.current_revision(RESPONSE_SCHEMA)
        self._request_header = SINGLE_OBJECT_MAGIC + self._request_rev.fingerprint.le_bytes
        self._response_header = SINGLE_OBJECT_MAGIC + self._response_rev.fingerprint.le_bytes
        self._request_check = _Check(
            "LLMRequest", self.limits, fast=_request_fast_ok,
            strings=_REQUEST_STRINGS, optional_strings=_REQUEST_OPTIONAL_STRINGS,
            big_field="prompt", big_cap=self.limits.max_prompt_bytes, big_limit="max_prompt_bytes",
            ints=_REQUEST_INTS, longs=_REQUEST_LONGS, optional_longs=_REQUEST_OPTIONAL_LONGS,
        )
        self._response_check = _Check(
            "LLMResponse", self.limits, fast=_response_fast_ok,
            strings=_RESPONSE_STRINGS, optional_strings=_RESPONSE_OPTIONAL_STRINGS,
            big_field="output", big_cap=self.limits.max_output_bytes, big_limit="max_output_bytes",
            ints=_RESPONSE_INTS, longs=_RESPONSE_LONGS,
            optional_longs=_RESPONSE_OPTIONAL_LONGS,
        )
        # (fingerprint bytes | schema id, store name) -> ReadPlan; only hits are cached.
        self._fp_plans: dict[tuple[bytes, str], ReadPlan] = {}
        self._id_plans: dict[tuple[int, str], ReadPlan] = {}
        # Generated codecs of the current revisions (None: fastavro only). The
        # single-object headers they serve are kept apart from the ones encoding uses,
        # so that None here turns the decoders' fast check off.
        self._fast_request = self._fast_response = None
        if fast:
            self._fast_request = self._compile_fast(self._request_rev, fastpath.REQUEST_BINDING, self._request_check)
            self._fast_response = self._compile_fast(
                self._response_rev, fastpath.RESPONSE_BINDING, self._response_check
            )
        self._fast_request_header = self._request_header if self._fast_request is not None else None
        self._fast_response_header = self._response_header if self._fast_response is not None else None
        self._fast_request_decode = self._fast_request.decode if self._fast_request is not None else None
        self._fast_response_decode = self._fast_response.decode if self._fast_response is not None else None
        # The C twin alone, for the hot path (None without it): one call, no Python frame.
        self._native_request_decode = self._fast_request.native_decode if self._fast_request is not None else None
        self._fast_response_values = self._fast_response.encode_values if self._fast_response is not None else None

    @property
    def fast(self) -> bool:
        """True if both records of the current schemas use the generated fast path."""
        return self._fast_request is not None and self._fast_response is not None

    def _compile_fast(self, rev: SchemaRevision, binding: fastpath.ModelBinding, check: _Check):
        limits = self.limits
        strings = {name: limits.max_string_bytes for name in check.strings + check.optional_strings}
        strings[check.big_field] = check.big_cap
        caps = fastpath.FieldCaps(
            max_record_bytes=limits.max_record_bytes,
            strings=strings,
            maps={"metadata": (limits.max_metadata_entries, "max_metadata_entries", limits.max_string_bytes)},
        )

        def late_check(obj: Any) -> tuple[str, str] | None:
            return check.problem(obj.to_record(), False)

        try:
            return fastpath.compile_codec(rev.parsed, binding, caps, late_check=late_check, source=rev.source)
        except fastpath.UnsupportedSchema:
            return None

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
        # The generated encoder reads the attributes itself, so only for the model
        # class proper: a subclass may override to_record().
        fast = self._fast_request if type(req) is Request else None
        if fast is not None and wire == "single-object":
            data = fast.encode(req, self._request_header)
            if data is not None:
                return data
            fast = None  # it bailed: fastavro explains (or accepts) the record
        try:
            rec = req.to_record()
        except AttributeError as exc:  # e.g. an enum field holding a plain string
            raise EncodeError(f"cannot encode LLMRequest {req.request_id!r}: {exc}") from exc
        if wire == "single-object":
            header = self._request_header
        else:
            header = self._registry_header(self._request_rev, wire, topic)
            if fast is not None:
                data = fast.encode(req, header)
                if data is not None:
                    return data
        return self._encode(rec, header, self._request_rev, self._request_check)

    def encode_response_values(self, values: tuple, wire: Wire = "single-object", topic: str | None = None) -> bytes:
        """Encode the response whose field values, in :data:`RESPONSE_FIELDS` order, are
        ``values``: the bytes of ``encode_response(Response(**dict(zip(RESPONSE_FIELDS, values))))``.

        For a hot path: with the native codec an ordinary response is written straight from
        the tuple, without building the :class:`Response`; anything else builds it and goes
        through :meth:`encode_response` (same bytes, same errors).
        """
        if wire == "single-object" and self._fast_response_values is not None:
            data = self._fast_response_values(values, self._response_header)
            if data is not None:
                return data
        return self.encode_response(Response(**dict(zip(RESPONSE_FIELDS, values))), wire, topic)

    def encode_response(self, resp: Response, wire: Wire = "single-object", topic: str | None = None) -> bytes:
        """Encode ``resp`` with the current response schema (see :meth:`encode_request`)."""
        if not isinstance(resp, Response):
            raise EncodeError(f"LLMResponse: encode_response needs a Response, got {type(resp).__name__}")
        fast = self._fast_response if type(resp) is Response else None
        if fast is not None and wire == "single-object":
            data = fast.encode(resp, self._response_header)
            if data is not None:
                return data
            fast = None
        try:
            rec = resp.to_record()
        except AttributeError as exc:  # e.g. an enum field holding a plain string
            raise EncodeError(f"cannot encode LLMResponse {resp.request_id!r}: {exc}") from exc
        if wire == "single-object":
            header = self._response_header
        else:
            header = self._registry_header(self._response_rev, wire, topic)
            if fast is not None:
                data = fast.encode(resp, header)
                if data is not None:
                    return data
        return self._encode(rec, header, self._response_rev, self._response_check)

    def _registry_header(self, rev: SchemaRevision, wire: str, topic: str | None) -> bytes:
        if wire != "confluent":
            raise EncodeError(f"{rev.fullname}: unknown wire format {wire!r} (use 'single-object' or 'confluent')")
        if self.registry is None:
            raise EncodeError(f"{rev.fullname}: the confluent wire format needs a schema registry")
        if not topic:
            raise EncodeError(f"{rev.fullname}: the confluent wire format needs a topic (for the subject name)")
        return self.registry.header(topic, rev)

    def _encode(self, rec: dict, header: bytes, rev: SchemaRevision, check: _Check) -> bytes:
        sink = _Sink(header)
        try:
            schemaless_writer(sink, rev.parsed, rec)
        except Exception as exc:
            raise EncodeError(f"{self._describe(rec, rev)}: {self._explain(rec, rev, exc)}") from exc
        problem = check.problem(rec, True)
        if problem is not None:
            raise EncodeError(f"{self._describe(rec, rev)}: {problem[1]}")
        if len(sink) > self._max_record_bytes:
            raise EncodeError(
                f"{self._describe(rec, rev)}: {len(sink)} bytes exceed max_record_bytes={self._max_record_bytes}"
            )
        return bytes(sink)

    @staticmethod
    def _describe(rec: dict, rev: SchemaRevision) -> str:
        return f"cannot encode {rev.fullname.rsplit('.', 1)[-1]} {rec.get('request_id')!r}"

    @staticmethod
    def _explain(rec: dict, rev: SchemaRevision, exc: Exception) -> str:
        # Only on the error path: fastavro's own messages name no field, its
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
        """Decode a request in either wire format. Raises :class:`DecodeError`."""
        # The hot path: single-object encoded with the current schema.
        if type(data) is bytes and data[:10] == self._fast_request_header:
            native = self._native_request_decode
            if native is not None:
                request = native(data, 10)
                if request is not None:
                    return request
                return self._fast_request.python_decode(data, 10)
            return self._fast_request_decode(data, 10)
        data, plan, offset = self._frame(data, REQUEST_SCHEMA)
        if plan.reader is None and self._fast_request is not None:  # e.g. confluent, same schema
            return self._fast_request.decode(data, offset)
        rec = self._read(data, plan, offset)
        problem = self._request_check.problem(rec, False)
        if problem is not None:
            raise DecodeError(*problem)
        try:
            return Request.from_record(rec)
        except (KeyError, ValueError, TypeError) as exc:
            raise DecodeError("invalid_field", f"LLMRequest: {exc}") from None

    def decode_response(self, data: bytes) -> Response:
        """Decode a response in either wire format. Raises :class:`DecodeError`."""
        if type(data) is bytes and data[:10] == self._fast_response_header:
            return self._fast_response_decode(data, 10)
        data, plan, offset = self._frame(data, RESPONSE_SCHEMA)
        if plan.reader is None and self._fast_response is not None:
            return self._fast_response.decode(data, offset)
        rec = self._read(data, plan, offset)
        problem = self._response_check.problem(rec, False)
        if problem is not None:
            raise DecodeError(*problem)
        try:
            return Response.from_record(rec)
        except (KeyError, ValueError, TypeError) as exc:
            raise DecodeError("invalid_field", f"LLMResponse: {exc}") from None

    @staticmethod
    def wire_format(data: bytes) -> str:
        """``"single-object"``, ``"confluent"`` or ``"unknown"``, from the first byte(s)."""
        if data[:2] == SINGLE_OBJECT_MAGIC:
            return "single-object"
        if data[:1] == b"\x00":
            return "confluent"
        return "unknown"

    def _frame(self, data: Any, name: str) -> tuple[bytes, ReadPlan, int]:
        """Check size and header: ``(data as bytes, read plan, offset of the body)``."""
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
            plan = self._fp_plans.get((fp, name))
            if plan is None:
                plan = self._plan_for_fingerprint(fp, name)
            offset = _SINGLE_OBJECT_HEADER_LEN
        elif first == 0:
            if size < _CONFLUENT_HEADER_LEN:
                raise DecodeError("truncated", f"confluent header needs 5 bytes, got {size}")
            schema_id = int.from_bytes(data[1:5], "big")
            plan = self._id_plans.get((schema_id, name))
            if plan is None:
                plan = self._plan_for_schema_id(schema_id, name)
            offset = _CONFLUENT_HEADER_LEN
        else:
            raise DecodeError("bad_magic", f"message starts with {data[:2].hex()}, not c301 or 00")
        return data, plan, offset

    @staticmethod
    def _read(data: bytes, plan: ReadPlan, offset: int) -> dict:
        """The body at ``data[offset:]`` read with fastavro, resolved per ``plan``."""
        size = len(data)
        stream = BytesIO(data)
        stream.seek(offset)
        try:
            rec = schemaless_reader(stream, plan.writer, plan.reader)
        except EOFError as exc:
            detail = f"body ends early ({plan.writer_source})"
            raise DecodeError("truncated", f"{detail}: {exc}" if str(exc) else detail) from None
        except IndexError:
            # fastavro raises IndexError both for a varint cut short by the end of the
            # data and for an enum/union index past the end of its list.
            if stream.tell() >= size:
                raise DecodeError("truncated", f"body ends inside a number ({plan.writer_source})") from None
            raise DecodeError("invalid_field", f"enum or union index out of range ({plan.writer_source})") from None
        except SchemaResolutionError as exc:
            raise DecodeError("invalid_field", f"cannot resolve to the reader schema: {exc}") from None
        except UnicodeDecodeError as exc:
            raise DecodeError("malformed", f"invalid UTF-8 in a string: {exc.reason}") from None
        except Exception as exc:  # whatever else fastavro may raise on garbage
            raise DecodeError("malformed", f"{type(exc).__name__}: {exc}") from None
        end = stream.tell()
        if end != size:
            if end > size:  # a short read that fastavro did not notice
                raise DecodeError("truncated", f"body needs more than the {size - offset} bytes present")
            raise DecodeError("malformed", f"{size - end} trailing bytes after the record")
        if type(rec) is not dict:
            raise DecodeError("malformed", f"decoded a {type(rec).__name__}, not a record")
        return rec

    def _plan_for_fingerprint(self, fp: bytes, name: str) -> ReadPlan:
        writer = self.store.writer_for_fingerprint(fp)
        reader = self.store.current_revision(name)
        if writer is None:
            raise SchemaNotFoundError("unknown_fingerprint", f"no published schema has fingerprint {fp.hex()}")
        if writer.fullname != reader.fullname:
            raise SchemaNotFoundError(
                "unknown_fingerprint",
                f"fingerprint {fp.hex()} is {writer.fullname} ({writer.source}), not {reader.fullname}",
            )
        plan = self.store.read_plan(writer, name)
        self._fp_plans[(fp, name)] = plan
        return plan

    def _plan_for_schema_id(self, schema_id: int, name: str) -> ReadPlan:
        if self.registry is None:
            raise SchemaNotFoundError(
                "unknown_schema_id", f"schema id {schema_id}: no schema registry configured for the confluent wire format"
            )
        writer = self.registry.writer_for_id(schema_id)  # SchemaNotFoundError / SerdeError
        reader = self.store.current_revision(name)
        if writer.fullname != reader.fullname:
            raise SchemaNotFoundError(
                "unknown_schema_id", f"schema id {schema_id} is {writer.fullname}, not {reader.fullname}"
            )
        plan = self.store.read_plan(writer, name)
        self._id_plans[(schema_id, name)] = plan
        return plan


@functools.lru_cache(maxsize=1)
def _default_codec() -> Codec:
    return Codec(SchemaStore.load(), SerdeLimits())

