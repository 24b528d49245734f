"""A response's chunks read back from the chunks topic, for a resumed (or background) stream.

Every chunk of a response is in its reply partition of ``<prefix>.chunks`` after the offset the
record kept when it was submitted (``chunks_from``). A reader thread reads that partition from
there, keeps this response's chunks in ``seq`` order without repeats
(:class:`~pipeline.chunks.ChunkOrder`) and hands them to the event loop. It stops at the chunk
with ``finish_reason``, or once the response has ended and the partition was read to where it
ended then (a response that streamed nothing, or lost chunks), or at ``deadline_s``.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import AsyncIterator, Callable

from confluent_kafka import Consumer, TopicPartition

from pipeline.chunks import ChunkOrder
from pipeline.errors import DecodeError
from pipeline.models import Chunk
from pipeline.responses.record import StoredResponse
from pipeline.serde import Codec

_END = object()


async def replay_chunks(settings, rec: StoredResponse, ended: Callable[[], bool], deadline_s: float,
                        codec: Codec | None = None) -> AsyncIterator[Chunk]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    codec = codec or Codec.default()
    topic = settings.topics.chunks

    def run() -> None:
        consumer = Consumer(settings.kafka.consumer_config(
            f"llmq-replay-{uuid.uuid4().hex[:8]}", **{"enable.partition.eof": False, "enable.auto.commit": False,
                                                       "fetch.wait.max.ms": 20}))
        try:
            tp = TopicPartition(topic, rec.reply_partition or 0, rec.chunks_from)
            consumer.assign([tp])
            order, until, end_at = ChunkOrder(), time.monotonic() + deadline_s, None
            position = rec.chunks_from
            while not stop.is_set() and time.monotonic() < until:
                if end_at is None and ended():
                    end_at = consumer.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=10)[1]
                if end_at is not None and position >= end_at:
                    break
                for msg in consumer.consume(200, 0.1):
                    if msg.error() is not None:
                        continue
                    position = msg.offset() + 1
                    if msg.key() is not None and msg.key().decode(errors="replace") != rec.request_id:
                        continue
                    try:
                        chunk = codec.decode_chunk(msg.value())
                    except DecodeError:
                        continue
                    if chunk.request_id != rec.request_id:
                        continue
                    for c in order.add(chunk):
                        loop.call_soon_threadsafe(queue.put_nowait, c)
                    if order.finished:
                        return
        finally:
            consumer.close()
            loop.call_soon_threadsafe(queue.put_nowait, _END)

    thread = threading.Thread(target=run, name="llmq-replay", daemon=True)
    thread.start()
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            yield item
    finally:
        stop.set()
