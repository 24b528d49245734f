"""The tenant registry: the records of the settings and the registry file, kept live from a compacted topic.

Every process that decides about tenants (the gateway, ``llmq serve``) holds one::

    registry = TenantRegistry(settings)
    registry.start()                       # reads <prefix>.tenants to its end, then follows it
    record = registry.get("acme")          # TenantRecord | None, lock-free
    auth = registry.authorize(request, headers, raw, now_ms)   # pipeline.tenants.policy.authorize
    registry.stop()

Records, later ones winning per tenant: ``[tenants.records]`` → ``[tenants] file`` → the topic.
The topic is keyed by tenant name, one JSON record per value (pipeline/tenants/record.py); a
tombstone (null value) drops the topic's record, so the file's (if any) applies again. A reader
thread applies each batch of records as one new snapshot (the dictionaries are replaced, never
changed in place), so a change is in force a poll (≈0.1 s) after it is written.

A record on the topic that does not parse is logged (its name, not its content) and skipped:
the tenant keeps the record it had. ``llmq tenants set`` validates before it writes.
"""

from __future__ import annotations

import logging
import time
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from pipeline.compacted import CompactedTopic
from pipeline.errors import ConfigError, KafkaOperationError
from pipeline.models import Request, now_ms
from pipeline.tenants.keys import hash_key
from pipeline.tenants.policy import Authorization, TenantPolicy, authorize
from pipeline.tenants.record import TenantRecord, from_json, parse_records
from pipeline.tenants.signing import SecretError, resolve_secret

log = logging.getLogger(__name__)

#: A resolved secret is read again after this long (a rotated env/file secret takes effect).
_SECRET_TTL_S = 10.0


def load_file(path: str) -> dict[str, TenantRecord]:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as exc:
        raise ConfigError("tenants.file", f"cannot read the registry file {p.name!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("tenants.file", f"the registry file {p.name!r} is not valid TOML: {exc}") from None
    return parse_records(data, p.name)


class TenantRegistry:
    def __init__(self, settings, *, env: Mapping[str, str] | None = None):
        self.settings = settings
        t = settings.tenants
        self.topic = t.topic(settings.topics.prefix)
        self.policy = TenantPolicy.from_settings(t)
        self._env = env
        self._base = parse_records(t.records, "tenants.records")
        if t.file:
            self._base.update(load_file(t.file))
        self._from_topic: dict[str, TenantRecord] = {}
        self._snapshot: tuple[dict[str, TenantRecord], dict[str, str]] = ({}, {})
        self._secrets: dict[str, tuple[float, bytes | None]] = {}
        self._listeners: list[Callable[[], None]] = []
        self._rebuild()
        self._topic = CompactedTopic(settings, self.topic, apply=self.apply, name="tenant registry",
                                     ensure=self.ensure, client_id="llmq-tenants")
        self.version = 0  # snapshots applied from the topic

    # -- reading ---------------------------------------------------------------------------

    def get(self, tenant: str) -> TenantRecord | None:
        return self._records.get(tenant)

    def by_key(self, api_key: str) -> TenantRecord | None:
        """The enabled tenant whose key this is (the key is hashed; None for an unknown key)."""
        key_hash = hash_key(api_key)
        records, by_hash = self._snapshot
        name = by_hash.get(key_hash)
        record = records.get(name) if name is not None else None
        return record if record is not None and record.enabled and key_hash in record.key_hashes else None

    def records(self) -> dict[str, TenantRecord]:
        return dict(self._records)

    def source(self, tenant: str) -> str:
        return "topic" if tenant in self._from_topic else "file" if tenant in self._base else "-"

    def __iter__(self) -> Iterator[TenantRecord]:
        return iter(list(self._records.values()))

    def secret(self, record: TenantRecord | None) -> bytes | None:
        """The record's signing secret, or None (none set, or it cannot be resolved: logged once a TTL)."""
        if record is None or not record.signing_secret:
            return None
        ref = record.signing_secret
        cached = self._secrets.get(ref)
        now = time.monotonic()
        if cached is not None and now - cached[0] < _SECRET_TTL_S:
            return cached[1]
        try:
            value: bytes | None = resolve_secret(ref, self.settings.tenants.secrets_dir, self._env)
        except SecretError as exc:
            log.warning("tenant %s: %s", record.name, exc)
            value = None
        self._secrets[ref] = (now, value)
        return value

    def authorize(self, request: Request, headers: Any = None, raw: bytes = b"",
                  now: int | None = None) -> Authorization:
        record = self._records.get(request.tenant_id)
        return authorize(request, record, headers, now_ms() if now is None else now, raw=raw,
                         secret=self.secret(record) if record is not None and record.require_signature else None,
                         policy=self.policy)

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the reader thread) after each snapshot read from the topic."""
        self._listeners.append(callback)

    # -- the topic ---------------------------------------------------------------------------

    def ensure(self) -> bool:
        """Create the registry topic if it is missing; True if it exists afterwards."""
        from confluent_kafka.admin import AdminClient

        from pipeline.topics import TopicSpec, ensure_topics

        t = self.settings.tenants
        spec = TopicSpec(self.topic, t.topic_partitions, self.settings.topics.replication_factor,
                         dict(t.topic_config), "tenant registry")
        try:
            ensure_topics(AdminClient(self.settings.kafka.admin_config()), [spec], timeout=15)
        except KafkaOperationError as exc:
            log.warning("cannot create the tenant registry topic %s: %s", self.topic, exc)
            return False
        return True

    def start(self, wait_s: float = 30.0) -> TenantRegistry:
        """Follow the topic on a thread; returns once what it held at start is applied (or raises)."""
        self._topic.start(wait_s)
        return self

    def wait_ready(self, timeout: float) -> bool:
        return self._topic.wait_ready(timeout)

    def stop(self) -> None:
        self._topic.stop()

    def publish(self, record: TenantRecord | None, name: str | None = None, timeout: float = 15.0) -> None:
        """Write ``record`` (None: a tombstone for ``name``) to the topic; returns once it is acknowledged."""
        name = record.name if record is not None else name
        if not name:
            raise ValueError("a tombstone needs the tenant's name")
        self._topic.publish(name.encode(), None if record is None else record.to_json(), timeout)

    def apply(self, records: Iterable[tuple[bytes | None, bytes | None]]) -> bool:
        """Apply topic records (key, value) as one new snapshot; True if anything changed."""
        changed = False
        for key, value in records:
            changed |= self._apply(key, value)
        if changed:
            self._rebuild()
            self.version += 1
            for callback in list(self._listeners):
                try:
                    callback()
                except Exception:  # noqa: BLE001 (a listener's bug must not stop the registry)
                    log.exception("tenant registry listener failed")
        return changed

    def _apply(self, key: bytes | None, value: bytes | None) -> bool:
        if not key:
            return False
        try:
            name = key.decode()
        except UnicodeDecodeError:
            log.warning("tenant registry: a record whose key is not UTF-8 skipped")
            return False
        if value is None:
            return self._from_topic.pop(name, None) is not None
        try:
            record = from_json(name, value)
        except ConfigError as exc:
            log.warning("tenant registry: record of %r skipped, it keeps the one it had: %s", name, exc.problem)
            return False
        self._from_topic[name] = record
        return True

    def _rebuild(self) -> None:
        records = {**self._base, **self._from_topic}
        by_hash: dict[str, str] = {}
        shared: set[str] = set()
        for record in records.values():
            for h in record.key_hashes:
                if h in by_hash and by_hash[h] != record.name:
                    shared.add(h)
                by_hash[h] = record.name
        for h in shared:
            # One key, two tenants: which one is meant cannot be told, so neither gets it.
            log.warning("tenant registry: a key is registered to more than one tenant; it is refused for all")
            del by_hash[h]
        # One assignment: a reader sees the records and their key index of the same snapshot.
        self._snapshot = (records, by_hash)

    @property
    def _records(self) -> dict[str, TenantRecord]:
        return self._snapshot[0]

    def __enter__(self) -> TenantRegistry:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
