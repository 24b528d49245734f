"""Incremental fetch sessions against the real broker: the broker grants one, and a consumer
fetching through it reads every record once, in order, across pauses and seeks."""

from __future__ import annotations

import asyncio
import uuid

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from pipeline.gateway.fetch_sessions import use_fetch_sessions

PARTITIONS = 6


def _topic(bootstrap: str) -> str:
    name = f"fetch-sessions-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, PARTITIONS, 1)])[name].result(30)
    return name


def _produce(bootstrap: str, topic: str, first: int, count: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    for i in range(first, first + count):
        producer.produce(topic, value=str(i).encode(), partition=i % PARTITIONS)
    assert producer.flush(30) == 0


async def _read(consumer, want: int, seen: list) -> None:
    deadline = asyncio.get_running_loop().time() + 30
    while len(seen) < want and asyncio.get_running_loop().time() < deadline:
        batches = await consumer.getmany(timeout_ms=200)
        for records in batches.values():
            seen.extend(int(r.value) for r in records)


def test_a_consumer_on_a_fetch_session_reads_everything_once_across_pauses_and_seeks(bootstrap):
    topic = _topic(bootstrap)
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]

    async def scenario():
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                    auto_offset_reset="earliest", fetch_max_wait_ms=50)
        await consumer.start()
        try:
            consumer.assign(tps)
            await consumer.seek_to_beginning()
            sessions = use_fetch_sessions(consumer._fetcher)
            seen: list = []
            for burst in range(5):  # records keep arriving in bursts: every fetch after the first is incremental
                await asyncio.to_thread(_produce, bootstrap, topic, burst * 60, 60)
                await _read(consumer, (burst + 1) * 60, seen)
            session_ids = {s.id for s in sessions.values()}
            assert session_ids and 0 not in session_ids, "the broker granted no fetch session"
            assert max(s.epoch for s in sessions.values()) > 0, "no incremental fetch was sent"
            assert sorted(seen) == list(range(300))

            consumer.pause(tps[0])  # forgotten by the session
            await asyncio.to_thread(_produce, bootstrap, topic, 300, 60)
            await _read(consumer, 350, seen)
            consumer.resume(tps[0])  # and named again, at its old offset
            await _read(consumer, 360, seen)
            assert sorted(seen) == list(range(360))

            consumer.seek(tps[1], 0)  # an offset that moved back: read its records again
            again: list = []
            await _read(consumer, PARTITIONS * 10, again)
            assert sorted(again) == list(range(1, 360, PARTITIONS))
            return sessions
        finally:
            await consumer.stop()

    asyncio.run(scenario())
