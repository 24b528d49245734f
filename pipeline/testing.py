"""Stand-ins for driving llmq's loops without a broker (unit tests, the fuzzer, benchmarks)."""

from __future__ import annotations


class FakeMessage:
    """Quacks like confluent_kafka.Message for ``Worker._handle``."""

    __slots__ = ("_topic", "_partition", "_offset", "_value", "_key", "_headers")

    def __init__(self, topic, partition, offset, value, key=None, headers=None):
        self._topic, self._partition, self._offset = topic, partition, offset
        self._value, self._key, self._headers = value, key, headers

    def error(self):
        return None

    def topic(self):
        return self._topic

    def partition(self):
        return self._partition

    def offset(self):
        return self._offset

    def value(self):
        return self._value

    def key(self):
        return self._key

    def headers(self):
        return self._headers
