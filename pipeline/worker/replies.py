"""Where a request's answer goes: the responses topic, or the topic and partition it asked for.

A request may name a ``reply_to`` topic (under the pipeline's prefix: validation refuses any
other, and the pipeline's own input, dead-letter and chunk topics) and a ``reply_partition``
(a client reading one partition of its own instead of every tenant's answers). What a
request asks is checked again here against what exists, because an answer produced to a
topic or partition that does not exist is never acknowledged: at-least-once it would be
retried for ever and hold its partition's commits back, exactly-once it would abort every
transaction it is in. So a reply topic the broker does not know falls back to the responses
topic, and a partition past the topic's last one to the tenant's partition (the key).
"""

from __future__ import annotations

import logging
import time

from pipeline.config import Settings
from pipeline.partitioning import ANY_PARTITION, tenant_partition
from pipeline.policy.validation import own_topics
from pipeline.worker.state import Session

log = logging.getLogger(__name__)

#: Topics whose partition counts are remembered (a front door names few reply topics).
_MAX_TOPICS = 1024
#: How long a reply topic found missing is not looked up again.
_MISSING_FOR_S = 30.0


class ReplyTargets:
    def __init__(self, settings: Settings, session: Session):
        topics = settings.topics
        self.prefix = topics.prefix + "."
        self.responses = topics.responses
        self.receipts = topics.receipts
        self.session = session
        # Never an answer's destination, whatever a request says (validation refuses them too).
        self._refused = own_topics(topics.prefix)
        #: topic → its partition count, or (None, when to look again) for a missing topic.
        self._partitions: dict[str, int | tuple] = {topics.responses: topics.response_partitions}
        self._response_partitions = topics.response_partitions

    def is_home(self, key: bytes, topic: str, partition: int | None) -> bool:
        """Whether an answer to ``topic``/``partition`` is where the gateway reads its tenant's
        completions (the responses topic, in the tenant's partition); if not, a receipt says it."""
        if topic != self.responses:
            return False
        if partition is ANY_PARTITION:
            return True
        return partition == tenant_partition(key, self._response_partitions)

    def of(self, request) -> tuple[str, int | None]:
        """``(topic, partition)`` for ``request``'s answers; partition ANY_PARTITION: the
        tenant's (by key)."""
        topic = self.responses
        reply_to = request.reply_to
        if reply_to is not None and reply_to != topic:
            if reply_to.startswith(self.prefix) and reply_to not in self._refused and self.partitions(reply_to):
                topic = reply_to
        partition = request.reply_partition
        if partition is None or partition < 0:
            return topic, ANY_PARTITION
        count = self.partitions(topic)
        return topic, (partition if count and partition < count else ANY_PARTITION)

    def fallback(self, topic: str, partition: int | None) -> tuple[str, int | None] | None:
        """Where to publish instead after the broker refused ``topic``/``partition`` as unknown,
        or None if that was the default destination already."""
        if topic == self.receipts:
            return None  # never instead of the responses: a receipt there would be a second answer
        if topic != self.responses:
            self._partitions[topic] = (None, time.monotonic() + _MISSING_FOR_S)
            return self.responses, ANY_PARTITION
        if partition is not ANY_PARTITION:
            return self.responses, ANY_PARTITION
        return None

    def partitions(self, topic: str) -> int | None:
        """The partition count of ``topic`` (looked up once), None while it seems missing."""
        known = self._partitions.get(topic)
        if isinstance(known, int):
            return known
        if known is not None and time.monotonic() < known[1]:
            return None
        count = self._look_up(topic)
        if len(self._partitions) < _MAX_TOPICS:
            self._partitions[topic] = count if count else (None, time.monotonic() + _MISSING_FOR_S)
        return count

    def _look_up(self, topic: str) -> int | None:
        producer = self.session.producer
        if producer is None:  # abandoned (see checkpoint.py): nothing goes out anyway
            return None
        try:
            md = producer.list_topics(topic, timeout=5).topics.get(topic)
        except Exception as exc:  # KafkaException, or a client without metadata
            log.warning("could not look up reply topic %s (%s); answering on %s", topic, exc, self.responses)
            return None
        if md is None or md.error is not None or not md.partitions:
            log.warning("reply topic %s does not exist; its answers go to %s", topic, self.responses)
            return None
        return len(md.partitions)
