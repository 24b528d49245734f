"""A request over a size cap, sent by any Kafka client, is answered REJECTED naming the limit, with a
gateway and without one, and nothing of it reaches the dead-letter topic."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from pipeline.models import Priority, Request, Status
from pipeline.serde import Codec, SerdeLimits
from tests.integration.gateway.test_gateway import running_gateway
from tests.integration.harness import read_topic, running_worker

PROMPT_BYTES = 900_000
REFUSAL = (f"invalid_request: prompt is {PROMPT_BYTES} bytes, over the {SerdeLimits().max_prompt_bytes}-byte limit "
           "(max_prompt_bytes)")


def _produce_raw(settings, *requests: Request) -> None:
    """Encoded without the codec's caps and produced with a plain producer: what the SDK would refuse
    to send, any other client can. Keyed by tenant, so they share a partition and keep their order."""
    codec = Codec(Codec.default().store, SerdeLimits(max_prompt_bytes=10**6))
    producer = Producer({"bootstrap.servers": settings.kafka.bootstrap})
    for req in requests:
        producer.produce(settings.topics.request_topic(req.priority), codec.encode_request(req),
                         req.tenant_id.encode())
    assert producer.flush(30) == 0


def _answers(settings, topic: str, ids: set[str], timeout: float = 20) -> dict:
    """request id → (its one answer, the partition it was read from), once every id in ``ids`` has one."""
    codec = Codec.default()

    def every(msgs):
        return ids <= {codec.decode_response(m.value()).request_id for m in msgs}

    msgs = read_topic(settings.kafka.bootstrap, topic, until=every, timeout=timeout)
    found: dict = {}
    for m in msgs:
        resp = codec.decode_response(m.value())
        found.setdefault(resp.request_id, []).append((resp, m.partition()))
    assert ids <= set(found), f"no answer for {ids - set(found)}"
    assert all(len(found[i]) == 1 for i in ids), "answered more than once"
    return {i: found[i][0] for i in ids}


def _wait_until_known(admin: AdminClient, topic: str, timeout: float = 15) -> None:
    """A reply topic the worker looks up before the broker knows all of it counts as missing (its
    answers go to the responses topic for a while): created is not enough."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        md = admin.list_topics(topic, timeout=5).topics.get(topic)
        if md is not None and md.error is None and md.partitions and all(p.leader >= 0 for p in md.partitions.values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"{topic} is not known to the broker after {timeout}s")


def _assert_no_dead_letters(settings) -> None:
    time.sleep(0.5)  # an output of the big request would have been produced before the later one's answer
    assert read_topic(settings.kafka.bootstrap, settings.topics.dlq, timeout=5) == []


def test_with_a_gateway_a_900kb_prompt_is_answered_rejected_naming_the_limit(settings, tmp_path):
    settings.worker.source = "dispatch"
    big = Request.new("acme", "p" * PROMPT_BYTES, priority=Priority.HIGH, reply_partition=1, timeout_ms=600_000)
    # Behind it on its partition, one the gateway answers itself (it needs no worker).
    after = Request.new("acme", "", priority=Priority.HIGH, timeout_ms=600_000)
    with running_gateway(settings, tmp_path):
        _produce_raw(settings, big, after)
        answers = _answers(settings, settings.topics.responses, {big.request_id, after.request_id})
    resp, partition = answers[big.request_id]
    assert resp.status is Status.REJECTED and resp.reason == REFUSAL
    assert (resp.tenant_id, resp.requested_priority, partition) == ("acme", Priority.HIGH, 1)
    assert answers[after.request_id][0].reason == "invalid_request: prompt is empty"
    _assert_no_dead_letters(settings)


@pytest.mark.parametrize("reply_to", [False, True], ids=["reply-partition", "reply-topic"])
def test_without_a_gateway_a_900kb_prompt_is_answered_rejected_naming_the_limit(settings, reply_to):
    assert settings.worker.source == "requests"  # workers read the request topics themselves
    topic = settings.topics.responses
    if reply_to:
        topic = f"{settings.topics.prefix}.replies.over-limit"
        admin = AdminClient({"bootstrap.servers": settings.kafka.bootstrap})
        admin.create_topics([NewTopic(topic, 3, 1)])[topic].result(30)
        _wait_until_known(admin, topic)
    big = Request.new("acme", "p" * PROMPT_BYTES, reply_partition=2, reply_to=topic if reply_to else None,
                      timeout_ms=600_000)
    after = Request.new("acme", "after the big one", reply_to=big.reply_to, timeout_ms=600_000)
    with running_worker(settings) as worker:
        _produce_raw(settings, big, after)
        answers = _answers(settings, topic, {big.request_id, after.request_id})
        stats = worker.stats
    resp, partition = answers[big.request_id]
    assert resp.status is Status.REJECTED and resp.reason == REFUSAL
    assert (resp.tenant_id, partition) == ("acme", 2)
    assert answers[after.request_id][0].status is Status.COMPLETED
    assert stats.rejected == 1 and stats.dead_lettered == 0
    _assert_no_dead_letters(settings)
