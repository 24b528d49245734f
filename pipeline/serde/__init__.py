"""Avro serialization of llmq records: schemas, fingerprints, limits and the codec.

Typical use::

    from pipeline.serde import Codec

    codec = Codec.default()
    data = codec.encode_request(request)
    request = codec.decode_request(data)

Responses and streamed chunks alike: ``encode_response``/``decode_response``,
``encode_chunk``/``decode_chunk``.
"""

from pipeline.serde.codec import (
    CHUNK_SCHEMA,
    REQUEST_SCHEMA,
    RESPONSE_FIELDS,
    RESPONSE_SCHEMA,
    SINGLE_OBJECT_MAGIC,
    Codec,
)
from pipeline.serde.fingerprint import (
    EMPTY,
    Fingerprint,
    canonical_fingerprint,
    canonical_form,
    crc64_avro,
    fingerprint_from_bytes,
    schema_fingerprint,
)
from pipeline.serde.limits import SerdeLimits
from pipeline.serde.registry import RegistryFormat
from pipeline.serde.schema_store import SchemaLoadError, SchemaRevision, SchemaStore

__all__ = [
    "CHUNK_SCHEMA",
    "Codec",
    "EMPTY",
    "Fingerprint",
    "REQUEST_SCHEMA",
    "RESPONSE_FIELDS",
    "RESPONSE_SCHEMA",
    "RegistryFormat",
    "SINGLE_OBJECT_MAGIC",
    "SchemaLoadError",
    "SchemaRevision",
    "SchemaStore",
    "SerdeLimits",
    "canonical_fingerprint",
    "canonical_form",
    "crc64_avro",
    "fingerprint_from_bytes",
    "schema_fingerprint",
]
