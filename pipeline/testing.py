"""Stand-ins for driving llmq's loops without a broker (unit tests, the fuzzer, benchmarks)."""

from __future__ import annotations


class FakeMessage:
    """Quacks like confluent_kafka.Message for ``Worker._handle``."""

    __slots__ = ("_topic", "_partition", "_offset", "_value", "_key", "_headers", "_timestamp")

    def __init__(self, topic, partition, offset, value, key=None, headers=None, timestamp_ms: int | None = None):
        self._topic, self._partition, self._offset = topic, partition, offset
        self._value, self._key, self._headers = value, key, headers
        self._timestamp = timestamp_ms

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

    def timestamp(self):
        """(type, ms) as confluent_kafka gives it: create time, or (0, -1) for none."""
        return (0, -1) if self._timestamp is None else (1, self._timestamp)


def produce_request(producer, settings, codec, request, topic: str | None = None) -> None:
    """Write ``request`` to its band's topic (or ``topic``), keyed by tenant, waiting for room in
    the producer's queue: for load generators (benchmarks, the fault harness, tests)."""
    topic = topic or settings.topics.request_topic(request.priority)
    value, key = codec.encode_request(request), request.tenant_id.encode()
    while True:
        try:
            producer.produce(topic, value, key)
            break
        except BufferError:
            producer.poll(0.02)
    producer.poll(0)


# -- raw Avro pieces, for writers of hostile messages (fuzzers, the hostile corpus) -----------------


def zigzag(n: int) -> bytes:
    """Avro's zig-zag varint of any Python int; beyond 64 bits it gives the over-long varints no
    Avro writer produces (which is the point, for hostile input)."""
    if -(1 << 63) <= n < (1 << 63):
        u = (n << 1) ^ (n >> 63)
    else:
        u = n << 1 if n >= 0 else ((-n) << 1) - 1
    out = bytearray()
    while u > 0x7F:
        out.append((u & 0x7F) | 0x80)
        u >>= 7
    out.append(u)
    return bytes(out)


def avro_string(value: str | bytes) -> bytes:
    """Length-prefixed bytes; text is UTF-8, lone surrogates included (so hostile text encodes)."""
    data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
    return zigzag(len(data)) + data
