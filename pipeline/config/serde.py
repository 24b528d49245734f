"""[serde]: record size caps, the schema registry and the wire format."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.fields import positive
from pipeline.errors import ConfigError
from pipeline.serde.limits import SerdeLimits


@dataclass
class SerdeSettings:
    max_record_bytes: int = SerdeLimits.max_record_bytes
    max_prompt_bytes: int = SerdeLimits.max_prompt_bytes
    max_metadata_entries: int = SerdeLimits.max_metadata_entries
    max_string_bytes: int = SerdeLimits.max_string_bytes
    max_output_bytes: int = SerdeLimits.max_output_bytes
    #: Confluent Schema Registry URL; empty means single-object encoding with local schemas.
    registry_url: str = ""
    #: Wire format for what llmq writes: "single-object" or "confluent" (needs registry_url).
    wire_format: str = "single-object"

    def limits(self) -> SerdeLimits:
        return SerdeLimits(
            max_record_bytes=self.max_record_bytes,
            max_prompt_bytes=self.max_prompt_bytes,
            max_metadata_entries=self.max_metadata_entries,
            max_string_bytes=self.max_string_bytes,
            max_output_bytes=self.max_output_bytes,
        )

    def validate(self) -> None:
        for key in ("max_record_bytes", "max_prompt_bytes", "max_metadata_entries", "max_string_bytes", "max_output_bytes"):
            positive(f"serde.{key}", getattr(self, key))
        if self.max_record_bytes < 4096:
            # A FAILED response carrying only ids and a reason must always fit.
            raise ConfigError("serde.max_record_bytes", f"must be >= 4096, got {self.max_record_bytes}")
        if self.wire_format not in ("single-object", "confluent"):
            raise ConfigError("serde.wire_format", "must be 'single-object' or 'confluent'")
        if self.wire_format == "confluent" and not self.registry_url:
            raise ConfigError("serde.registry_url", "required when serde.wire_format = 'confluent'")
