"""Typed settings for every llmq process, from one TOML file plus environment overrides.

Precedence (lowest to highest): built-in defaults → the file named by ``--config`` or
``LLMQ_CONFIG`` → environment variables → explicit command-line flags.

Environment variables:

* ``LLMQ_BOOTSTRAP`` — shortcut for ``kafka.bootstrap``.
* ``LLMQ_<SECTION>__<KEY>`` — any scalar setting, e.g. ``LLMQ_WORKER__MAX_INFLIGHT=32``
  or ``LLMQ_TOPICS__PREFIX=staging.llm``.
* ``LLMQ_RDKAFKA_<NAME>`` — a librdkafka property passed through untouched to every
  client, with ``_`` read as ``.``: ``LLMQ_RDKAFKA_LINGER_MS=10`` sets ``linger.ms``.

Settings render the property dicts that confluent-kafka takes (``producer_config()``,
``consumer_config()``, ``admin_config()``); user properties from ``[kafka.properties]``
win over llmq's defaults, so any librdkafka knob is reachable.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from pipeline.config.batch import BatchSettings
from pipeline.config.broker import DEFAULT_JVM_OPTIONS, BrokerSettings
from pipeline.config.fields import set_field
from pipeline.config.gateway import GatewaySettings
from pipeline.config.kafka import DEFAULT_BOOTSTRAP, KafkaSettings
from pipeline.config.models import ModelSettings
from pipeline.config.responses import ResponsesSettings
from pipeline.config.serde import SerdeSettings
from pipeline.config.serve import ServeSettings
from pipeline.config.tenants import TenantSettings
from pipeline.config.topics import DEFAULT_POOLS, TopicSettings
from pipeline.config.worker import WorkerSettings
from pipeline.errors import ConfigError

__all__ = ["DEFAULT_BOOTSTRAP", "DEFAULT_JVM_OPTIONS", "DEFAULT_POOLS", "BatchSettings", "BrokerSettings", "GatewaySettings",
           "KafkaSettings", "ModelSettings", "ResponsesSettings", "SerdeSettings", "ServeSettings", "Settings", "TenantSettings", "TopicSettings",
           "WorkerSettings"]


@dataclass
class Settings:
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    topics: TopicSettings = field(default_factory=TopicSettings)
    serde: SerdeSettings = field(default_factory=SerdeSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    tenants: TenantSettings = field(default_factory=TenantSettings)
    serve: ServeSettings = field(default_factory=ServeSettings)
    batch: BatchSettings = field(default_factory=BatchSettings)
    models: ModelSettings = field(default_factory=ModelSettings)
    responses: ResponsesSettings = field(default_factory=ResponsesSettings)

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> "Settings":
        """Defaults, then the TOML file (``path`` or ``$LLMQ_CONFIG``), then the environment."""
        env = os.environ if env is None else env
        settings = cls()
        path = path or env.get("LLMQ_CONFIG") or None
        if path:
            p = Path(path)
            if not p.is_file():
                raise ConfigError("LLMQ_CONFIG", f"config file {str(p)!r} does not exist")
            try:
                data = tomllib.loads(p.read_text())
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(str(p), f"not valid TOML: {exc}") from exc
            settings._apply_mapping(data)
        settings._apply_env(env)
        settings.validate()
        return settings

    def _apply_mapping(self, data: Mapping[str, Any]) -> None:
        sections = {f.name for f in dataclasses.fields(self)}
        for section, values in data.items():
            if section not in sections:
                raise ConfigError(section, f"unknown section (known: {', '.join(sorted(sections))})")
            if not isinstance(values, Mapping):
                raise ConfigError(section, "must be a table")
            target = getattr(self, section)
            for key, value in values.items():
                set_field(target, f"{section}.{key}", key, value, from_env=False)

    def _apply_env(self, env: Mapping[str, str]) -> None:
        if env.get("LLMQ_BOOTSTRAP"):
            self.kafka.bootstrap = env["LLMQ_BOOTSTRAP"]
        for name, raw in env.items():
            if name.startswith("LLMQ_RDKAFKA_"):
                prop = name[len("LLMQ_RDKAFKA_"):].lower().replace("_", ".")
                self.kafka.properties[prop] = raw
            elif name.startswith("LLMQ_") and "__" in name:
                section, _, key = name[len("LLMQ_"):].lower().partition("__")
                if not hasattr(self, section) or section.startswith("_"):
                    raise ConfigError(name, f"unknown section {section!r}")
                set_field(getattr(self, section), name, key, raw, from_env=True)

    def topology_env(self) -> dict[str, str]:
        """The environment that gives a child process (``llmq gateway``, ``llmq worker``, a
        benchmark's client) this settings' broker, topics and worker group: what must agree
        between the processes of one pipeline."""
        t = self.topics
        return {"LLMQ_BOOTSTRAP": self.kafka.bootstrap, "LLMQ_TOPICS__PREFIX": t.prefix,
                "LLMQ_TOPICS__REQUEST_PARTITIONS": str(t.request_partitions),
                "LLMQ_TOPICS__RESPONSE_PARTITIONS": str(t.response_partitions),
                "LLMQ_TOPICS__DISPATCH_PARTITIONS": str(t.dispatch_partitions),
                "LLMQ_TOPICS__REPLICATION_FACTOR": str(t.replication_factor),
                "LLMQ_WORKER__GROUP_ID": self.worker.group_id}

    def validate(self) -> None:
        for section in (self.kafka, self.topics, self.serde, self.worker, self.gateway, self.broker, self.tenants,
                        self.serve, self.batch, self.models, self.responses):
            section.validate()
