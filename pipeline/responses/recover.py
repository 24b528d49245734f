"""Answers to pending responses whose serve process went away, read from the responses topic.

A background response's answer lands in its record's reply partition of ``<prefix>.responses``,
after ``answers_from``, whether or not the process that submitted it still listens there (it
was SIGKILLed, restarted with another reply partition, or stopped). Each serve process looks,
every ``responses.recover_interval_s``, for pending records no task of its own waits for, and
reads their partitions from the earliest ``answers_from`` to the end, keeping the terminal
answers to their request ids. It remembers how far it read per partition, and reads again from
further back only for records it had not looked for yet.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from confluent_kafka import Consumer, TopicPartition

from pipeline.errors import DecodeError
from pipeline.models import Response
from pipeline.serde import Codec


@dataclass
class _Partition:
    position: int = 0
    looked_for: set[str] = field(default_factory=set)


class AnswerScanner:
    def __init__(self, settings, codec: Codec | None = None):
        self.settings = settings
        self.topic = settings.topics.responses
        self.codec = codec or Codec.default()
        self._parts: dict[int, _Partition] = {}

    def scan(self, partition: int, wanted: dict[str, int]) -> dict[str, Response]:
        """The terminal answers found for ``wanted`` (request id → the offset its answers start
        from) in ``partition`` (blocking: run it off the event loop)."""
        state = self._parts.setdefault(partition, _Partition())
        new = [rid for rid in wanted if rid not in state.looked_for]
        start = min(wanted[rid] for rid in new) if new else state.position
        if new and state.looked_for:
            start = min(start, state.position)
        found: dict[str, Response] = {}
        consumer = Consumer(self.settings.kafka.consumer_config(
            f"llmq-recover-{uuid.uuid4().hex[:8]}", **{"enable.partition.eof": False, "enable.auto.commit": False,
                                                        "fetch.wait.max.ms": 20}))
        try:
            end = consumer.get_watermark_offsets(TopicPartition(self.topic, partition), timeout=10)[1]
            position = start
            if start < end:
                consumer.assign([TopicPartition(self.topic, partition, start)])
                while position < end:
                    msgs = consumer.consume(500, 1.0)
                    if not msgs:
                        break
                    for msg in msgs:
                        if msg.error() is not None:
                            continue
                        position = msg.offset() + 1
                        if msg.value() is None:
                            continue
                        try:
                            resp = self.codec.decode_response(msg.value())
                        except DecodeError:
                            continue
                        if resp.request_id in wanted and resp.status.is_terminal:
                            found.setdefault(resp.request_id, resp)
        finally:
            consumer.close()
        state.position = max(state.position, position)
        state.looked_for = set(wanted) - set(found)
        return found
