"""The records the worker's parts hand each other: what to publish, what was answered, what was
taken from a queue. Typed, so no part reads another's data by position.

NamedTuples, not dataclasses, for the ones made per request on the hot path: they cost what a
tuple costs. ``Taken`` is filled in as its request goes through the stages, so it is a slotted
dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from pipeline.models import Request
from pipeline.partitioning import ANY_PARTITION
from pipeline.worker.backends.base import Completion
from pipeline.worker.offsets import TopicPartitionKey


class Outcome(NamedTuple):
    """One message to publish: an answer, a receipt or a dead letter."""

    topic: str
    value: bytes | None
    key: bytes | None
    headers: list | None = None
    #: None: the producer's partitioner picks the key's partition.
    partition: int | None = ANY_PARTITION


class Answered(NamedTuple):
    """A COMPLETED answer for the request taken at ``tp``/``offset``."""

    tp: TopicPartitionKey
    offset: int
    request: Request
    completion: Completion


@dataclass(slots=True)
class Taken:
    """A request on its way through the processor's stages, at its place among the chunk's
    answers (``index``); ``answered`` once the backend answered it at once."""

    msg: Any
    request: Request
    answered: Answered | None
    index: int
    #: Its entry in its band's fair queue (pipeline/policy/fair_queue.py), or None.
    waiting: Any = None


def rd_partition(partition: int | None) -> int:
    """librdkafka's spelling of a partition: -1 (``RD_KAFKA_PARTITION_UA``) for any."""
    return -1 if partition is None else partition
