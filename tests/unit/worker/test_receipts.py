"""A dispatched request answered where the gateway does not read (a reply topic, a reply partition
other than its tenant's) also gets a receipt: the answer without its text, on the receipts topic,
keyed by tenant, so the gateway that owns the tenant frees its quota. Its offset finishes only once
the receipt is acknowledged too."""

from __future__ import annotations

import asyncio
import dataclasses

from pipeline.config import Settings
from pipeline.models import Request, Status, now_ms
from pipeline.partitioning import tenant_partition
from tests.unit.worker.test_chunk_publisher import CODEC, MetadataProducer, make_worker, sent, take, until

S = Settings.load(env={})
REPLY_TO = f"{S.topics.prefix}.replies.frontend-1"
TOPICS = {REPLY_TO: 4, S.topics.responses: S.topics.response_partitions, S.topics.chunks: 6, S.topics.receipts: 6}


def admitted(request: Request) -> Request:
    return dataclasses.replace(request, admitted_at=now_ms(), effective_priority=request.priority)


def run(*requests, producer=None):
    async def go():
        worker = make_worker(producer=producer or MetadataProducer(TOPICS))
        for offset, request in enumerate(requests):
            take(worker, request, offset)
        worker.dispatch()
        await until(lambda: worker.stats.completed == len(requests))
        return worker

    return asyncio.run(go())


def test_an_answer_sent_elsewhere_comes_with_a_receipt_without_its_text():
    home = tenant_partition(b"t", S.topics.response_partitions)
    elsewhere = (home + 1) % S.topics.response_partitions
    to_topic = admitted(Request.new("t", "a", max_tokens=3, reply_to=REPLY_TO))
    to_partition = admitted(Request.new("t", "b", max_tokens=3, reply_partition=elsewhere))
    worker = run(to_topic, to_partition)
    receipts = [CODEC.decode_response(m.value()) for m in sent(worker, S.topics.receipts)]
    assert sorted(r.request_id for r in receipts) == sorted([to_topic.request_id, to_partition.request_id])
    assert all(r.status is Status.COMPLETED and r.output is None and r.completion_tokens > 0 for r in receipts)
    assert all(m.key() == b"t" for m in sent(worker, S.topics.receipts))
    [answer] = sent(worker, REPLY_TO)
    assert CODEC.decode_response(answer.value()).output  # the client's copy keeps the text


def test_no_receipt_where_the_gateway_reads_the_answer_or_no_gateway_dispatched_it():
    home = tenant_partition(b"t", S.topics.response_partitions)
    plain = admitted(Request.new("t", "a", max_tokens=2))
    own_partition = admitted(Request.new("t", "b", max_tokens=2, reply_partition=home))
    no_gateway = Request.new("t", "c", max_tokens=2, reply_to=REPLY_TO)  # read from a request topic
    worker = run(plain, own_partition, no_gateway)
    assert sent(worker, S.topics.receipts) == []
    assert len(sent(worker, S.topics.responses)) == 2 and len(sent(worker, REPLY_TO)) == 1


class HoldingProducer(MetadataProducer):
    """Acknowledges nothing until told: a receipt exists only once its answer is acknowledged."""

    def __init__(self, topics):
        super().__init__(topics)
        self.waiting = []

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None, partition=-1, **kw):
        super().produce(topic, value, key, headers, None, partition=partition, **kw)
        self.waiting.append((on_delivery, self.sent[-1]))

    def acknowledge(self):
        waiting, self.waiting = self.waiting, []
        for callback, msg in waiting:
            if callback is not None:
                callback(None, msg)


def test_the_offset_finishes_once_the_answer_and_then_its_receipt_are_acknowledged():
    producer = HoldingProducer(TOPICS)
    request = admitted(Request.new("t", "a", max_tokens=2, reply_to=REPLY_TO))
    worker = run(request, producer=producer)
    tp = (S.topics.request_topic(request.priority), 0)
    assert sent(worker, S.topics.receipts) == [] and tp not in dict(worker.checkpoint.tracker.to_commit())
    producer.acknowledge()  # the answer
    assert len(sent(worker, S.topics.receipts)) == 1 and tp not in dict(worker.checkpoint.tracker.to_commit())
    producer.acknowledge()  # its receipt
    assert dict(worker.checkpoint.tracker.to_commit())[tp] == 1


def test_exactly_once_the_receipt_waits_in_the_same_transaction_as_its_answer():
    request = admitted(Request.new("t", "a", max_tokens=2, reply_to=REPLY_TO))
    worker = run(request, producer=MetadataProducer(TOPICS))  # at-least-once, for comparison
    assert len(sent(worker, S.topics.receipts)) == 1

    async def go():
        w = make_worker(producer=MetadataProducer(TOPICS), delivery="exactly-once")
        take(w, request)
        w.dispatch()
        await until(lambda: w.stats.completed == 1)
        return w

    w = asyncio.run(go())
    [held] = w.checkpoint.ready[(S.topics.request_topic(request.priority), 0)].values()
    assert [topic for topic, *_ in held] == [REPLY_TO, S.topics.receipts]
    assert sent(w, S.topics.receipts) == []  # nothing outside the transaction
