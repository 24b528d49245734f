"""Dead letters, as the hot path writes them: the original bytes of a message llmq could
not read, and why.

The value and key are copied byte for byte; the reason travels in ``llmq.dlq.*`` headers so
that any Kafka tool can inspect or replay a dead letter without llmq. This module is the
record's format and nothing else: the header names, :func:`dead_letter_headers` to write
them, the size cap (:data:`MAX_DEAD_LETTER_BYTES`) and :func:`header_dict` to read them back:
what the worker and the gateway import to dead-letter a message.

The operator's tools over the dead-letter topic (``llmq dlq list|show|replay``: reading,
showing, replaying) are in :mod:`pipeline.dlq_tools`. They are apart so that the processes
on the hot path import only the format, none of the tools' readers, transactional producer
or terminal formatting; the tools import from here, never the other way round.
"""

from __future__ import annotations

import time

H_SOURCE_TOPIC = "llmq.dlq.source.topic"
H_SOURCE_PARTITION = "llmq.dlq.source.partition"
H_SOURCE_OFFSET = "llmq.dlq.source.offset"
H_REASON = "llmq.dlq.reason"
H_ERROR = "llmq.dlq.error"
H_STAGE = "llmq.dlq.stage"
H_FAILED_AT = "llmq.dlq.failed.at"

_MAX_ERROR_CHARS = 1000
RESERVED_PREFIX = "llmq."
#: Above this, a dead letter keeps only the head of the original value (and says so).
MAX_DEAD_LETTER_BYTES = 8 * 1024 * 1024
H_TRUNCATED = "llmq.dlq.truncated.from"

#: On a replayed copy: the dead letter it is a copy of, ``<dlq topic>:<partition>:<offset>``.
H_REPLAYED_FROM = "llmq.replayed-from"

#: A producer header renamed by dead_letter_headers: the dead letter is of a replayed copy.
H_ORIGINAL_REPLAYED_FROM = "original." + H_REPLAYED_FROM


def dead_letter_headers(topic: str, partition: int, offset: int, reason: str, error: str, stage: str,
                        original_headers: list[tuple[str, bytes]] | None = None) -> list[tuple[str, bytes]]:
    headers = [
        (H_SOURCE_TOPIC, topic.encode()),
        (H_SOURCE_PARTITION, str(partition).encode()),
        (H_SOURCE_OFFSET, str(offset).encode()),
        (H_REASON, reason.encode()),
        (H_ERROR, error[:_MAX_ERROR_CHARS].encode("utf-8", "replace")),
        (H_STAGE, stage.encode()),
        (H_FAILED_AT, str(int(time.time() * 1000)).encode()),
    ]
    # Keep the producer's own headers after ours (they are data, never trusted). Any in
    # llmq's namespace are renamed, so a producer cannot forge the reason or the source.
    if original_headers:
        headers.extend((f"original.{k}" if k.startswith(RESERVED_PREFIX) else k, v if v is not None else b"")
                       for k, v in original_headers)
    return headers


def header_dict(headers: list[tuple[str, bytes]] | None) -> dict[str, str]:
    """The llmq.dlq.* headers of a dead letter, decoded (for tools and tests)."""
    return {k: (v or b"").decode("utf-8", "replace") for k, v in (headers or []) if k.startswith("llmq.dlq.")}
