"""The codec a process should use, from its settings (limits, registry, wire format).

Takes the ``[serde]`` settings without importing :mod:`pipeline.config`: config sits at
the bottom of the import graph and imports :mod:`pipeline.serde.limits` itself.
"""

from __future__ import annotations

from typing import Protocol

from pipeline.serde.codec import Codec
from pipeline.serde.limits import SerdeLimits
from pipeline.serde.schema_store import SchemaStore


class SerdeOptions(Protocol):
    """What :func:`codec_for` reads of the settings (``pipeline.config.SerdeSettings``)."""

    registry_url: str

    def limits(self) -> SerdeLimits: ...


def codec_for(serde: SerdeOptions) -> Codec:
    limits = serde.limits()
    if limits == SerdeLimits() and not serde.registry_url:
        return Codec.default()
    registry = None
    if serde.registry_url:
        from pipeline.serde.registry import RegistryFormat

        registry = RegistryFormat.from_url(serde.registry_url)
    return Codec(SchemaStore.load(), limits, registry)
