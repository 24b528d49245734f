"""Confluent Schema Registry wire format: ``0x00`` + 4-byte big-endian schema id + body.

:class:`RegistryFormat` registers (or looks up) the current schema under a subject
and caches its id for encoding, and resolves the ids found in messages to writer
schemas for decoding. Writer schemas fetched from the registry get the same checks
as published ones (see :mod:`pipeline.serde.schema_store`) before anything is decoded
with them.

A ``mock://`` URL gives confluent-kafka's in-memory mock registry, but only through
``SchemaRegistryClient.new_client(conf)`` (what :meth:`RegistryFormat.from_url` uses):
constructing ``SchemaRegistryClient({"url": "mock://..."})`` directly makes a real HTTP
client that fails on first use. Each mock client has its own private store, so a
producer and a consumer that should see the same schemas must share one client.

confluent-kafka's schema-registry package (httpx and friends) is imported only when
a client is built here, not when this module is imported.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Callable

from pipeline.errors import EncodeError, SchemaNotFoundError, SerdeError
from pipeline.serde.schema_store import SchemaLoadError, SchemaRevision, prepare_schema

__all__ = [
    "CONFLUENT_MAGIC",
    "RegistryFormat",
    "SubjectStrategy",
    "record_name_strategy",
    "topic_name_strategy",
    "topic_record_name_strategy",
]

#: First byte of a Confluent-framed message.
CONFLUENT_MAGIC = b"\x00"

#: ``(topic, record fullname) -> subject``
SubjectStrategy = Callable[[str, str], str]


def topic_name_strategy(topic: str, record_fullname: str) -> str:
    """Confluent's default TopicNameStrategy for values: ``<topic>-value``."""
    return f"{topic}-value"


def record_name_strategy(topic: str, record_fullname: str) -> str:
    """RecordNameStrategy: the record's full name."""
    return record_fullname


def topic_record_name_strategy(topic: str, record_fullname: str) -> str:
    """TopicRecordNameStrategy: ``<topic>-<record fullname>``."""
    return f"{topic}-{record_fullname}"


class RegistryFormat:
    """Encodes schema ids into, and resolves them out of, Confluent-framed messages.

    ``client`` is a ``confluent_kafka.schema_registry.SchemaRegistryClient`` (or the
    mock). ``auto_register=False`` only looks schemas up, for registries where
    producers may not register. Registry answers "not found" are remembered for
    ``miss_ttl_s`` seconds so a flood of messages with a bad id does not become a
    flood of registry requests; ids whose schema is unusable are remembered for good.
    """

    def __init__(
        self,
        client: Any,
        subject_strategy: SubjectStrategy = topic_name_strategy,
        *,
        auto_register: bool = True,
        miss_ttl_s: float = 10.0,
        max_remembered_misses: int = 4096,
    ):
        self.client = client
        self.subject_strategy = subject_strategy
        self.auto_register = auto_register
        self.miss_ttl_s = miss_ttl_s
        self.max_remembered_misses = max_remembered_misses
        self._ids: dict[tuple[str, bytes], int] = {}
        self._writers: dict[int, SchemaRevision] = {}
        self._misses: dict[int, tuple[float, str]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        subject_strategy: SubjectStrategy = topic_name_strategy,
        *,
        auto_register: bool = True,
        **client_conf: Any,
    ) -> RegistryFormat:
        """A format backed by a new client for ``url`` (``mock://<name>`` for the mock).

        ``client_conf`` is passed on to the client (e.g. ``basic.auth.user.info``).
        """
        from confluent_kafka.schema_registry import SchemaRegistryClient

        client = SchemaRegistryClient.new_client({"url": url, **client_conf})
        return cls(client, subject_strategy, auto_register=auto_register)

    # -- encoding --------------------------------------------------------------

    def schema_id(self, topic: str, schema: SchemaRevision) -> int:
        """The registry id of ``schema`` under the subject for ``topic`` (cached).

        Raises :class:`EncodeError` when the registry refuses or cannot be reached.
        """
        subject = self.subject_strategy(topic, schema.fullname)
        key = (subject, schema.fingerprint.le_bytes)
        schema_id = self._ids.get(key)
        if schema_id is not None:
            return schema_id
        from confluent_kafka.schema_registry import Schema

        text = json.dumps(schema.raw, separators=(",", ":"))
        try:
            if self.auto_register:
                schema_id = self.client.register_schema(subject, Schema(text, "AVRO"))
            else:
                schema_id = self.client.lookup_schema(subject, Schema(text, "AVRO")).schema_id
        except Exception as exc:  # SchemaRegistryError, transport errors
            action = "register" if self.auto_register else "look up"
            raise EncodeError(f"cannot {action} {schema.fullname} under subject {subject!r}: {exc}") from exc
        schema_id = int(schema_id)
        with self._lock:
            self._ids[key] = schema_id
            # We know what this id means; no need to fetch it back when decoding.
            self._writers.setdefault(schema_id, schema)
        return schema_id

    def header(self, topic: str, schema: SchemaRevision) -> bytes:
        """``0x00`` + the 4-byte big-endian id of ``schema`` for ``topic``."""
        return CONFLUENT_MAGIC + self.schema_id(topic, schema).to_bytes(4, "big")

    # -- decoding --------------------------------------------------------------

    def writer_for_id(self, schema_id: int) -> SchemaRevision:
        """The checked, parsed writer schema registered as ``schema_id`` (cached).

        Raises :class:`SchemaNotFoundError` (reason ``unknown_schema_id``) when the
        registry does not know the id or its schema is unusable here (not Avro, uses
        references, not a record, fails the schema checks), and a plain
        :class:`SerdeError` when the registry cannot be asked (the message may be
        fine: retry rather than dead-letter it).
        """
        writer = self._writers.get(schema_id)
        if writer is not None:
            return writer
        miss = self._misses.get(schema_id)
        if miss is not None:
            if miss[0] > time.monotonic():
                raise SchemaNotFoundError("unknown_schema_id", miss[1])
            self._misses.pop(schema_id, None)

        try:
            registered = self.client.get_schema(schema_id)
        except Exception as exc:
            if getattr(exc, "http_status_code", None) == 404:
                detail = f"schema id {schema_id} is not in the registry"
                self._remember_miss(schema_id, detail, self.miss_ttl_s)
                raise SchemaNotFoundError("unknown_schema_id", detail) from None
            raise SerdeError(f"schema registry lookup of id {schema_id} failed: {exc}") from exc

        try:
            writer = self._prepare(schema_id, registered)
        except SchemaLoadError as exc:
            detail = f"registry schema id {schema_id} is unusable: {exc}"
            self._remember_miss(schema_id, detail, math.inf)
            raise SchemaNotFoundError("unknown_schema_id", detail) from None
        with self._lock:
            writer = self._writers.setdefault(schema_id, writer)
        return writer

    @staticmethod
    def _prepare(schema_id: int, registered: Any) -> SchemaRevision:
        source = f"registry schema id {schema_id}"
        schema_type = getattr(registered, "schema_type", None) or "AVRO"
        if schema_type != "AVRO":
            raise SchemaLoadError(f"{source}: a {schema_type} schema, not Avro")
        if getattr(registered, "references", None):
            raise SchemaLoadError(f"{source}: schema references are not supported")
        text = registered.schema_str
        try:
            raw = json.loads(text)
        except Exception as exc:  # ValueError, TypeError, RecursionError on absurd nesting
            raise SchemaLoadError(f"{source}: not valid JSON: {exc}") from exc
        return prepare_schema(raw, name=f"registry:{schema_id}", revision=None, source=source, json_text=text)

    def _remember_miss(self, schema_id: int, detail: str, ttl_s: float) -> None:
        with self._lock:
            if len(self._misses) >= self.max_remembered_misses:
                now = time.monotonic()
                self._misses = {k: v for k, v in self._misses.items() if v[0] > now}
                if len(self._misses) >= self.max_remembered_misses:
                    self._misses.clear()
            self._misses[schema_id] = (time.monotonic() + ttl_s, detail)
