"""[tenants]: the tenant registry (pipeline/tenants/): who a tenant is, what it may ask for.

Records come from three places, later ones winning per tenant: ``records`` (inline tables of
this section), the registry ``file`` (TOML, one table per tenant), then the compacted topic
``<prefix>.tenants`` that ``llmq tenants set`` writes and every registry follows live.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.config.fields import BAND_NAMES, positive
from pipeline.errors import ConfigError
from pipeline.models import Priority


@dataclass
class TenantSettings:
    #: A TOML file of tenant records, read at start (``[acme]`` tables, pipeline/tenants/record.py).
    file: str = ""
    #: Inline records: tenant → the same table as in the file.
    records: dict[str, Any] = field(default_factory=dict)
    #: A tenant missing from the registry: refused ``unauthorized`` (true) or served as
    #: ``default_tier`` with the gateway's default limits (false, the default).
    require_known: bool = False
    default_tier: str = "standard"
    #: The highest band a tenant missing from the registry may ask for.
    default_max_priority: str = "CRITICAL"
    #: Where ``file:NAME`` signing-secret references are read from (a secret never sits in a
    #: record, only its reference); empty = only ``env:NAME`` references work.
    secrets_dir: str = ""
    #: A signed request whose created_at is further than this from the checker's clock is
    #: refused: a captured request cannot be replayed later (ids are only remembered so long).
    signature_max_age_ms: int = 300_000
    #: The compacted topic (``<prefix>.<topic_suffix>``) that carries live changes.
    topic_suffix: str = "tenants"
    topic_partitions: int = 1
    topic_config: dict[str, str] = field(default_factory=lambda: {"cleanup.policy": "compact",
                                                                  "min.compaction.lag.ms": "0"})

    def topic(self, prefix: str) -> str:
        return f"{prefix}.{self.topic_suffix}"

    def validate(self) -> None:
        if not self.default_tier.strip():
            raise ConfigError("tenants.default_tier", "must name a tier")
        if self.default_max_priority not in Priority.__members__:
            raise ConfigError("tenants.default_max_priority", f"unknown band (known: {BAND_NAMES})")
        positive("tenants.signature_max_age_ms", self.signature_max_age_ms)
        positive("tenants.topic_partitions", self.topic_partitions)
        if not self.topic_suffix or any(c.isspace() or c == "/" for c in self.topic_suffix):
            raise ConfigError("tenants.topic_suffix", "must be a plain topic name part")
        if not isinstance(self.records, dict):
            raise ConfigError("tenants.records", "must be a table of tenants")
        # Each record's own rules live with the records (pipeline/tenants/record.py): the
        # registry checks them when it is built, before a gateway or serve takes traffic.
