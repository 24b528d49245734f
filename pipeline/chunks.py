"""Reading streamed answers: a request's chunks, in order, from the chunks topic.

Workers publish the text of a request with ``stream`` set as ``LLMChunk`` records on
``<prefix>.chunks``, keyed by request id, numbered ``seq`` 0, 1, 2, ..., the last with
``finish_reason``; in the request's ``reply_partition`` when it has one, else in its
tenant's partition (:func:`chunk_partition`). Chunks are progress, best effort: a request
run again (after a worker crash) streams again from seq 0, and a chunk may be missing. The
request's terminal response, with the whole text, is what ends a stream whatever happened to
its chunks.

:class:`ChunkOrder` puts one request's chunks in order and drops repeats (pure);
:class:`ChunkReader` reads the topic and yields a request's chunks through it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from typing import Iterable, Iterator

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from pipeline.config import Settings
from pipeline.errors import DecodeError
from pipeline.models import Chunk
from pipeline.partitioning import tenant_partition
from pipeline.serde import Codec

log = logging.getLogger(__name__)

#: Chunks past a gap kept per request, waiting for the missing one.
MAX_AHEAD = 4096
#: Requests whose chunks a reader keeps apart at once (the oldest are forgotten first).
MAX_REQUESTS = 10_000


def chunk_partition(partitions: int, tenant_id: str, reply_partition: int | None = None) -> int:
    """The partition of the chunks topic (of ``partitions``) a request's chunks go to: its
    ``reply_partition`` when it names one that exists, else its tenant's."""
    if reply_partition is not None and 0 <= reply_partition < partitions:
        return reply_partition
    return tenant_partition(tenant_id.encode(), partitions)


class ChunkOrder:
    """One request's chunks as they arrive, given back in ``seq`` order without repeats.

    A chunk already given (a second run of the request, a redelivery) is dropped; one past a
    gap is kept until the gap fills (:meth:`rest` gives what is kept, when the stream ended
    without it).
    """

    def __init__(self) -> None:
        self.next_seq = 0
        self.finished = False  # the chunk with finish_reason was given
        self._ahead: dict[int, Chunk] = {}

    def add(self, chunk: Chunk) -> list[Chunk]:
        """The chunks now due, in order (none when ``chunk`` repeats one or comes early)."""
        seq = chunk.seq
        if self.finished or seq < self.next_seq:
            return []
        if seq > self.next_seq:
            if len(self._ahead) < MAX_AHEAD:
                self._ahead.setdefault(seq, chunk)
            return []
        out = [chunk]
        self.next_seq += 1
        ahead = self._ahead
        while ahead and self.next_seq in ahead:
            out.append(ahead.pop(self.next_seq))
            self.next_seq += 1
        for i, c in enumerate(out):
            if c.finish_reason is not None:
                self.finished = True
                self._ahead.clear()
                return out[: i + 1]
        return out

    def rest(self) -> list[Chunk]:
        """What came past a gap that never filled, in order (the stream is over)."""
        out = [self._ahead[s] for s in sorted(self._ahead)]
        self._ahead.clear()
        if out:
            self.next_seq = out[-1].seq + 1
            self.finished = self.finished or out[-1].finish_reason is not None
        return out


class ChunkReader:
    """Reads the chunks topic from its end as of construction (or from its beginning), on the
    given partitions (default: all), and hands out each request's chunks in order.

    Create it before submitting the requests whose chunks it is to read: it starts at the end
    offsets it finds when created, so it sees everything published after that.
    """

    def __init__(self, settings: Settings, *, partitions: Iterable[int] | None = None, codec: Codec | None = None,
                 from_beginning: bool = False, consumer: Consumer | None = None):
        self.topic = settings.topics.chunks
        self.codec = codec or Codec.default()
        self._consumer = consumer or Consumer(settings.kafka.consumer_config(
            f"llmq-streams-{uuid.uuid4().hex[:8]}",  # assign() only: the group is never joined
            **{"enable.partition.eof": False, "fetch.wait.max.ms": 10}))
        if partitions is None:
            md = self._consumer.list_topics(self.topic, timeout=10).topics.get(self.topic)
            partitions = sorted(md.partitions) if md is not None and md.error is None else []
        assigned = []
        for p in partitions:
            if from_beginning:
                offset = OFFSET_BEGINNING
            else:
                # Concrete end offsets, not OFFSET_END: that would be resolved at the first
                # fetch, after chunks of a request submitted meanwhile were published.
                offset = self._end_offset(p)
            assigned.append(TopicPartition(self.topic, p, offset))
        self._consumer.assign(assigned)
        self._orders: OrderedDict[str, ChunkOrder] = OrderedDict()
        self._pending: OrderedDict[str, list[Chunk]] = OrderedDict()  # due, not yet handed to stream()

    def _end_offset(self, partition: int, timeout_s: float = 30.0) -> int:
        # A topic just created may have no leader for a moment.
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._consumer.get_watermark_offsets(TopicPartition(self.topic, partition), timeout=10)[1]
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def poll(self, timeout: float = 0.1, max_messages: int = 500) -> list[Chunk]:
        """What arrived within ``timeout``: every request's chunks now due, each request's in
        order (repeats dropped)."""
        out: list[Chunk] = []
        for msg in self._consumer.consume(max_messages, timeout):
            if msg.error() is not None or msg.value() is None:
                continue
            try:
                chunk = self.codec.decode_chunk(msg.value())
            except DecodeError as exc:
                log.warning("skipping an unreadable chunk at %s[%d]@%d: %s", msg.topic(), msg.partition(),
                            msg.offset(), exc.reason)
                continue
            out.extend(self._order(chunk.request_id).add(chunk))
        return out

    def _order(self, request_id: str) -> ChunkOrder:
        order = self._orders.get(request_id)
        if order is None:
            order = self._orders[request_id] = ChunkOrder()
            if len(self._orders) > MAX_REQUESTS:
                self._orders.popitem(last=False)
        return order

    def stream(self, request_id: str, timeout_s: float = 60.0) -> Iterator[Chunk]:
        """``request_id``'s chunks in order, until the one with ``finish_reason`` (or
        ``timeout_s`` without a new chunk: the stream stops, and its terminal response says
        how the request ended). Chunks of other requests read meanwhile are kept for their
        own :meth:`stream`."""
        pending = self._pending
        order = self._order(request_id)
        ready = pending.pop(request_id, [])
        last = time.monotonic()
        while True:
            for chunk in ready:
                yield chunk
                if chunk.finish_reason is not None:
                    return
            if order.finished:
                return
            if time.monotonic() - last > timeout_s:
                return
            ready = []
            for chunk in self.poll(0.05):
                if chunk.request_id == request_id:
                    ready.append(chunk)
                else:
                    pending.setdefault(chunk.request_id, []).append(chunk)
                    if len(pending) > MAX_REQUESTS:
                        pending.popitem(last=False)
            if ready:
                last = time.monotonic()

    def forget(self, request_id: str) -> None:
        """The request is over: drop what is kept for it."""
        self._orders.pop(request_id, None)
        self._pending.pop(request_id, None)

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> "ChunkReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
