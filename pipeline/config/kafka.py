"""[kafka]: how every llmq process reaches the brokers, and the client properties it renders."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config.fields import read_secret_file
from pipeline.errors import ConfigError

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

#: librdkafka's log lines go to this Python logger instead of stderr; pipeline/kafka_log.py
#: (installed by the CLI) rate-limits its connection failures. Only the name lives here, so
#: config imports nothing above it.
KAFKA_LOGGER = "pipeline.kafka"

# Properties llmq sets itself for correctness; users may still override them on purpose.
_PRODUCER_DEFAULTS = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 5,
    "compression.type": "lz4",
    # Java-compatible key hashing, so any Kafka client keyed by tenant lands on the same partition.
    "partitioner": "murmur2_random",
}
_CONSUMER_DEFAULTS = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "auto.offset.reset": "earliest",
    "partition.assignment.strategy": "cooperative-sticky",
    "fetch.wait.max.ms": 50,
}


_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_SASL_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN")


@dataclass
class KafkaSettings:
    bootstrap: str = DEFAULT_BOOTSTRAP
    client_id: str = "llmq"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "SCRAM-SHA-512"
    sasl_username: str = ""
    #: Prefer sasl_password_file; the password itself is never logged or shown in repr().
    sasl_password: str = field(default="", repr=False)
    sasl_password_file: str = ""
    #: CA bundle (PEM) that signed the brokers' certificates; hostname verification stays on.
    ssl_ca_location: str = ""
    #: librdkafka properties passed through untouched (``[kafka.properties]`` in the file).
    properties: dict[str, Any] = field(default_factory=dict, repr=False)
    #: A client's (SDK, serve) producer with a record outstanding this long is replaced by a new
    #: one (pipeline/renewing_producer.py); 0 = never.
    producer_renew_after_ms: int = 30_000

    def password(self) -> str:
        if self.sasl_password_file:
            return read_secret_file("kafka.sasl_password_file", self.sasl_password_file)
        return self.sasl_password

    def common_config(self) -> dict[str, Any]:
        conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap, "client.id": self.client_id,
                                # confluent-kafka passes each line to it from the thread that
                                # polls the client (poll, consume, flush)
                                "logger": logging.getLogger(KAFKA_LOGGER),
                                # A client that can reach none of the brokers its metadata names
                                # (a replicated cluster restarted, then a node killed) bootstraps
                                # again from bootstrap.servers after this long (KIP-1102), not
                                # after librdkafka's 5 minutes, during which `make chaos` saw
                                # producers hold their records and consumers fetch nothing.
                                "metadata.recovery.rebootstrap.trigger.ms": 30_000}
        if self.security_protocol != "PLAINTEXT":
            conf["security.protocol"] = self.security_protocol
        if self.security_protocol.startswith("SASL_"):
            conf["sasl.mechanism"] = self.sasl_mechanism
            conf["sasl.username"] = self.sasl_username
            conf["sasl.password"] = self.password()
        if self.security_protocol in ("SSL", "SASL_SSL") and self.ssl_ca_location:
            conf["ssl.ca.location"] = self.ssl_ca_location
        return conf

    def producer_config(self, **overrides: Any) -> dict[str, Any]:
        return {**self.common_config(), **_PRODUCER_DEFAULTS, **overrides, **self.properties}

    def consumer_config(self, group_id: str, **overrides: Any) -> dict[str, Any]:
        """An override of None removes the property (llmq's default included)."""
        conf = {
            **self.common_config(),
            **_CONSUMER_DEFAULTS,
            "group.id": group_id,
            **overrides,
            **self.properties,
        }
        return {k: v for k, v in conf.items() if v is not None}

    def aiokafka_config(self) -> dict[str, Any]:
        """The same connection settings for aiokafka (Faust's kafka:// driver)."""
        conf: dict[str, Any] = {"bootstrap_servers": self.bootstrap, "client_id": self.client_id,
                                "security_protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL_"):
            conf.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                        sasl_plain_password=self.password())
        if self.security_protocol in ("SSL", "SASL_SSL"):
            import ssl

            # Hostname verification and certificate checks stay on (the ssl module's defaults).
            conf["ssl_context"] = ssl.create_default_context(cafile=self.ssl_ca_location or None)
        return conf

    def admin_config(self) -> dict[str, Any]:
        # Producer/consumer-only properties make the admin client warn; keep only shared ones.
        shared = {k: v for k, v in self.properties.items()
                  if k.startswith(("security.", "sasl.", "ssl.", "socket.", "client."))}
        return {**self.common_config(), **shared}

    def validate(self) -> None:
        if not self.bootstrap.strip():
            raise ConfigError("kafka.bootstrap", "must not be empty")
        if self.producer_renew_after_ms < 0:
            raise ConfigError("kafka.producer_renew_after_ms", "must be >= 0 (0: never)")
        k = self
        if k.security_protocol not in _SECURITY_PROTOCOLS:
            raise ConfigError("kafka.security_protocol", f"must be one of {', '.join(_SECURITY_PROTOCOLS)}")
        if k.security_protocol.startswith("SASL_"):
            if k.sasl_mechanism not in _SASL_MECHANISMS:
                raise ConfigError("kafka.sasl_mechanism", f"must be one of {', '.join(_SASL_MECHANISMS)}")
            if not k.sasl_username:
                raise ConfigError("kafka.sasl_username", f"required with security_protocol {k.security_protocol}")
            if not (k.sasl_password or k.sasl_password_file):
                raise ConfigError("kafka.sasl_password_file",
                                  "a password (kafka.sasl_password_file, or LLMQ_KAFKA__SASL_PASSWORD) is required")
            if k.sasl_mechanism == "PLAIN" and k.security_protocol == "SASL_PLAINTEXT":
                raise ConfigError("kafka.sasl_mechanism", "PLAIN over SASL_PLAINTEXT sends the password in clear "
                                                          "text; use SASL_SSL")
        if k.ssl_ca_location and not Path(k.ssl_ca_location).expanduser().is_file():
            raise ConfigError("kafka.ssl_ca_location", f"no such file {k.ssl_ca_location!r}")
