"""[models]: the model names callers use, and how they map to the names the servers know.

A model server answers only the names it serves (vLLM answers 404 to any other), so llmq learns
them: each worker pool reads its servers' ``GET /v1/models`` and publishes what they serve to
the compacted topic ``<prefix>.models`` (pipeline/catalog/). Serve and the gateway read it:
``/v1/models`` lists those names, a request for a name nobody serves is refused before it is
queued, and a request that names no model runs on the default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.fields import positive
from pipeline.errors import ConfigError


@dataclass
class ModelSettings:
    #: The model of a request that names none (the SDK's and ``llmq submit``'s default). Empty:
    #: the first model the pool's servers list on /v1/models.
    default: str = ""
    #: Public names callers may use → the name the servers know, as LiteLLM's model list maps
    #: them (``{"gpt-4o-mini" = "Qwen/Qwen2.5-0.5B-Instruct"}``). Listed by /v1/models beside the
    #: served names; the answer carries the name the caller asked for.
    aliases: dict[str, str] = field(default_factory=dict)
    #: Refuse a model that no pool serves: 404 model_not_found at serve, REJECTED by the gateway.
    #: Only once the catalog knows something (a pool has published): before that, requests pass
    #: and a worker answers one its servers do not know FAILED model_unavailable.
    refuse_unknown: bool = True
    #: How often a worker reads its servers' /v1/models again and republishes the list.
    refresh_s: float = 60.0
    #: A pool's list that has not been republished for this long no longer counts (its workers
    #: are gone): a few refresh periods.
    ttl_s: float = 300.0
    #: The compacted topic (``<prefix>.<topic_suffix>``) the pools publish their lists to.
    topic_suffix: str = "models"

    def topic(self, prefix: str) -> str:
        return f"{prefix}.{self.topic_suffix}"

    def validate(self) -> None:
        positive("models.refresh_s", self.refresh_s)
        positive("models.ttl_s", self.ttl_s)
        if self.ttl_s < self.refresh_s:
            raise ConfigError("models.ttl_s", f"must be at least models.refresh_s ({self.refresh_s}), "
                                              f"or every list expires before it is renewed")
        for public, served in self.aliases.items():
            if not isinstance(served, str) or not public.strip() or not served.strip():
                raise ConfigError("models.aliases", f"{public!r} = {served!r}: both names must be non-empty strings")
        if not self.topic_suffix.strip():
            raise ConfigError("models.topic_suffix", "must be a non-empty name")
