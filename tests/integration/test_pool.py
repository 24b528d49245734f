"""Several workers of one pool share the work: every band's partitions, not just a partition count."""

from __future__ import annotations

import collections
import time

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from pipeline.models import Priority, Request
from pipeline.serde import Codec
from pipeline.worker.backends.simulated import SimulatedBackend
from tests.integration.harness import read_topic, running_worker


def _bands_held(worker) -> dict[str, int]:
    held = collections.Counter()
    for tp in worker.consumer.assignment() if worker.consumer is not None else []:
        held[tp.topic.rsplit(".", 1)[-1]] += 1
    return dict(held)


def _wait_until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def _settled(workers, partitions: int) -> bool:
    owned = [tp for w in workers if w.consumer is not None for tp in w.consumer.assignment()]
    return len(owned) == partitions and len(set(owned)) == partitions and all(_bands_held(w) for w in workers)


def test_a_worker_joining_a_running_pool_gets_a_share_of_every_band(settings):
    # The classic protocol's cooperative-sticky assignor balances only how many partitions each
    # member has: the second worker got whole bands while the first kept NORMAL and LOW.
    total = len(Priority) * settings.topics.request_partitions
    with running_worker(settings, worker_id="first") as first:
        _wait_until(lambda: _settled([first], total), 30, "the first worker owns every partition")
        with running_worker(settings, worker_id="second") as second:
            _wait_until(lambda: _settled([first, second], total), 30, "the two workers split the partitions")
            for worker in (first, second):
                assert set(_bands_held(worker)) == {p.value.lower() for p in Priority}, _bands_held(worker)


def test_a_busy_band_is_answered_by_every_worker_of_the_pool(settings):
    n = 240
    codec = Codec.default()
    total = len(Priority) * settings.topics.request_partitions
    settings.worker.max_inflight = 2
    # Model-bound workers (20 ms a call, two at a time), as LLM workers are: sharing the band
    # is what makes a second worker worth having.
    with running_worker(settings, SimulatedBackend(latency_ms=20), worker_id="first") as first:
        _wait_until(lambda: _settled([first], total), 30, "the first worker owns every partition")
        with running_worker(settings, SimulatedBackend(latency_ms=20), worker_id="second") as second:
            _wait_until(lambda: _settled([first, second], total), 30, "the two workers split the partitions")
            producer = Producer(settings.kafka.producer_config())
            topic = settings.topics.request_topic(Priority.NORMAL)
            for i in range(n):
                req = Request.new(f"tenant-{i % 60}", f"p{i}", priority=Priority.NORMAL, max_tokens=2,
                                  timeout_ms=600_000)
                producer.produce(topic, codec.encode_request(req), req.tenant_id.encode())
            assert producer.flush(30) == 0
            msgs = read_topic(settings.kafka.bootstrap, settings.topics.responses, timeout=90,
                              until=lambda ms: len(ms) >= n)
    by_worker = collections.Counter(codec.decode_response(m.value()).worker_id for m in msgs)
    assert sum(by_worker.values()) == n
    assert min(by_worker["first"], by_worker["second"]) >= n // 5, by_worker


def test_workers_set_their_groups_session_timeout_under_the_consumer_protocol(settings):
    settings.worker.session_timeout_ms = 7_000
    with running_worker(settings) as worker:
        _wait_until(lambda: worker.consumer is not None and worker.consumer.assignment(), 30, "an assignment")
    admin = AdminClient(settings.kafka.admin_config())
    resource = ConfigResource(ResourceType.GROUP, settings.worker.group_id)
    configs = admin.describe_configs([resource])[resource].result(15)
    assert configs["consumer.session.timeout.ms"].value == "7000"
    assert configs["consumer.heartbeat.interval.ms"].value == "2333"


def _owned(worker) -> set[tuple[str, int]]:
    return {(tp.topic, tp.partition) for tp in worker.consumer.assignment()}


def test_a_static_member_restarted_within_its_session_gets_its_partitions_back_and_nothing_moves(settings):
    settings.worker.static_membership = True
    settings.worker.session_timeout_ms = 30_000
    total = len(Priority) * settings.topics.request_partitions
    with running_worker(settings, worker_id="keeper") as keeper:
        with running_worker(settings, worker_id="restarted") as first:
            _wait_until(lambda: _settled([keeper, first], total), 30, "the two workers split the partitions")
            kept, theirs = _owned(keeper), _owned(first)
        # Stopped (a rolling restart): its partitions wait for it instead of moving to the keeper
        # (which would hear of a move at its next heartbeat, at most 5 s away on any broker).
        time.sleep(6)
        assert _owned(keeper) == kept
        with running_worker(settings, worker_id="restarted") as again:
            _wait_until(lambda: again.consumer is not None and _owned(again) == theirs, 20,
                        "the restarted worker gets its partitions back")
            assert _owned(keeper) == kept


def test_a_session_the_broker_refuses_is_logged_and_the_worker_runs_on(settings, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="pipeline.worker.membership")
    settings.worker.session_timeout_ms = 1_000  # under the broker's group.consumer.min.session.timeout.ms
    with running_worker(settings) as worker:
        _wait_until(lambda: worker.consumer is not None and worker.consumer.assignment(), 30, "an assignment")
    assert f"could not set group {settings.worker.group_id}'s session (consumer.session.timeout.ms=1000" in caplog.text
    assert "the broker's defaults apply" in caplog.text


def test_a_longer_session_gives_the_heartbeat_back_to_the_broker(settings):
    from pipeline.worker.membership import apply_group_session

    group = settings.worker.group_id
    admin = AdminClient(settings.kafka.admin_config())
    resource = ConfigResource(ResourceType.GROUP, group)

    def heartbeat_is_the_groups(value: str | None = None) -> bool:
        configs = admin.describe_configs([resource])[resource].result(15)
        own = configs["consumer.session.timeout.ms"].source  # set on the group
        heartbeat = configs["consumer.heartbeat.interval.ms"]
        return heartbeat.source == own and (value is None or heartbeat.value == value)

    # Group configs go through the cluster's metadata log: the broker shows them a moment later.
    settings.worker.session_timeout_ms = 6_000
    assert apply_group_session(settings, group)
    _wait_until(lambda: heartbeat_is_the_groups("2000"), 10, "a 2 s heartbeat for a 6 s session")
    settings.worker.session_timeout_ms = 45_000
    assert apply_group_session(settings, group)
    _wait_until(lambda: not heartbeat_is_the_groups(), 10, "the broker's heartbeat for a 45 s session")
