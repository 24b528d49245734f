"""Size caps applied to every record the codec encodes or decodes."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SerdeLimits"]

#: Strings with a cap of their own, by where they sit in a record (the body check's paths:
#: ``Record.field``, ``[]`` for an array's items, ``.field`` inside a nested record), and
#: the limit that caps them. A chat message's content is prompt text, so it gets the
#: prompt's cap rather than the one for names and ids.
_OWN_CAPS = {
    "LLMRequest.prompt": "max_prompt_bytes",
    "LLMRequest.messages[].content": "max_prompt_bytes",
    "LLMResponse.output": "max_output_bytes",
    "LLMChunk.delta": "max_output_bytes",
}

#: Arrays with an item cap of their own; every other array has ``max_array_items``.
_OWN_ITEM_CAPS = {"LLMRequest.messages": "max_messages"}

_NAMES = ("max_record_bytes", "max_prompt_bytes", "max_metadata_entries", "max_string_bytes", "max_output_bytes",
          "max_messages", "max_array_items")


@dataclass(frozen=True)
class SerdeLimits:
    """Upper bounds on encoded records and on their fields.

    ``max_record_bytes`` is checked on the raw message before any decoding; together
    with the schema store's rule that every array/map item consumes at least one byte,
    it bounds the work one message can cause. The other caps are checked on the encoded
    body (lengths in UTF-8 bytes, entries and items as encoded) before it is decoded,
    and on every body the codec encodes:

    * ``max_prompt_bytes``: ``LLMRequest.prompt`` and the ``content`` of each of
      ``LLMRequest.messages``
    * ``max_output_bytes``: ``LLMResponse.output`` and ``LLMChunk.delta``
    * ``max_string_bytes``: every other string (and bytes value), including metadata keys
      and values
    * ``max_metadata_entries``: entries in a map (the records' ``metadata``)
    * ``max_messages``: items in ``LLMRequest.messages``
    * ``max_array_items``: items in any other array (``LLMRequest.stop``); fastavro would
      otherwise build a list as long as the message allows
    """

    max_record_bytes: int = 1_048_576
    max_prompt_bytes: int = 262_144
    max_metadata_entries: int = 64
    max_string_bytes: int = 65_536
    max_output_bytes: int = 1_048_576
    max_messages: int = 256
    max_array_items: int = 64

    def __post_init__(self) -> None:
        for name in _NAMES:
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"SerdeLimits.{name} must be a non-negative int, got {value!r}")

    def string_cap(self, record: str, field: str) -> tuple[int, str]:
        """``(cap in UTF-8 bytes, name of the limit)`` of the strings in top-level field
        ``field`` of record ``record`` (its short name, e.g. ``LLMRequest``)."""
        return self.cap_at(f"{record}.{field}")

    def cap_at(self, where: str) -> tuple[int, str]:
        """``(cap in UTF-8 bytes, name of the limit)`` of the strings at ``where``, a path
        such as ``LLMRequest.prompt`` or ``LLMRequest.messages[].content``."""
        name = _OWN_CAPS.get(where, "max_string_bytes")
        return getattr(self, name), name

    def items_cap_at(self, where: str) -> tuple[int, str]:
        """``(most items, name of the limit)`` of the array at ``where`` (e.g. ``LLMRequest.stop``)."""
        name = _OWN_ITEM_CAPS.get(where, "max_array_items")
        return getattr(self, name), name
