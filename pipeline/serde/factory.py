"""The codec a process should use, from its settings (limits, registry, wire format)."""

from __future__ import annotations

from pipeline.config import SerdeSettings
from pipeline.serde.codec import Codec
from pipeline.serde.limits import SerdeLimits
from pipeline.serde.schema_store import SchemaStore


def codec_for(serde: SerdeSettings) -> Codec:
    limits = serde.limits()
    if limits == SerdeLimits() and not serde.registry_url:
        return Codec.default()
    registry = None
    if serde.registry_url:
        from pipeline.serde.registry import RegistryFormat

        registry = RegistryFormat.from_url(serde.registry_url)
    return Codec(SchemaStore.load(), limits, registry)
