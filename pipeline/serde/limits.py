"""Size caps applied to every record the codec encodes or decodes."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SerdeLimits"]

#: The string field of each record (by short name) with a cap of its own, and that cap.
_OWN_CAPS = {"LLMRequest": ("prompt", "max_prompt_bytes"), "LLMResponse": ("output", "max_output_bytes")}


@dataclass(frozen=True)
class SerdeLimits:
    """Upper bounds on encoded records and on their fields.

    ``max_record_bytes`` is checked on the raw message before any decoding; together
    with the schema store's rule that every array/map item consumes at least one byte,
    it bounds the work one message can cause. The other caps are checked on the encoded
    body (lengths in UTF-8 bytes, entries as encoded) before it is decoded, and on every
    body the codec encodes:

    * ``max_prompt_bytes``: ``LLMRequest.prompt``
    * ``max_output_bytes``: ``LLMResponse.output``
    * ``max_string_bytes``: every other string (and bytes value), including metadata keys
      and values
    * ``max_metadata_entries``: entries in a map (the records' ``metadata``)
    """

    max_record_bytes: int = 1_048_576
    max_prompt_bytes: int = 262_144
    max_metadata_entries: int = 64
    max_string_bytes: int = 65_536
    max_output_bytes: int = 1_048_576

    def __post_init__(self) -> None:
        for name in (
            "max_record_bytes",
            "max_prompt_bytes",
            "max_metadata_entries",
            "max_string_bytes",
            "max_output_bytes",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"SerdeLimits.{name} must be a non-negative int, got {value!r}")

    def string_cap(self, record: str, field: str) -> tuple[int, str]:
        """``(cap in UTF-8 bytes, name of the limit)`` of the strings in top-level field
        ``field`` of record ``record`` (its short name, e.g. ``LLMRequest``)."""
        own = _OWN_CAPS.get(record)
        if own is not None and own[0] == field:
            return getattr(self, own[1]), own[1]
        return self.max_string_bytes, "max_string_bytes"
