"""The lag exporter against the real broker: numbers, naming, caching and scrape cost."""

from __future__ import annotations

import time
import urllib.request

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from pipeline.models import Priority
from pipeline.observability.lag import LagCollector, LagReader, build_registry
from pipeline.observability.metrics import serve
from tests.integration.harness import free_port, make_settings


def _commit(bootstrap: str, group: str, offsets: dict[tuple[str, int], int]) -> None:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=False)
    finally:
        consumer.close()


def _produce(bootstrap: str, topic: str, partition: int, n: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(n):
        producer.produce(topic, b"x", partition=partition)
    assert producer.flush(10) == 0


def _samples(registry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples}


def test_lag_matches_offsets_never_negative_and_reports_groups_without_members(settings):
    bootstrap = settings.kafka.bootstrap
    high = settings.topics.request_topic(Priority.HIGH)
    group = f"llmq-{settings.topics.prefix}-pool"
    _produce(bootstrap, high, 0, 10)
    _produce(bootstrap, high, 1, 4)
    _commit(bootstrap, group, {(high, 0): 7})  # partition 1 never committed, partition 2 empty

    reader = LagReader(settings, group_pattern=f"^{group}$")
    collector = LagCollector(reader, interval_s=60)
    collector.refresh()
    s = _samples(build_registry(collector))
    key = lambda p: (("consumergroup", group), ("partition", str(p)), ("topic", high))  # noqa: E731
    assert s[("kafka_consumergroup_lag", key(0))] == 3
    assert s[("kafka_consumergroup_current_offset", key(0))] == 7
    assert s[("kafka_consumergroup_lag", key(1))] == 4  # no commit: all its data is lag, never -1
    assert ("kafka_consumergroup_current_offset", key(1)) not in s
    assert s[("kafka_consumergroup_lag_sum", (("consumergroup", group), ("topic", high)))] == 7
    assert s[("llmq_consumergroup_uncommitted_partitions", (("consumergroup", group), ("topic", high)))] == 1
    assert s[("kafka_topic_partition_current_offset", (("partition", "0"), ("topic", high)))] == 10
    assert s[("kafka_consumergroup_members", (("consumergroup", group),))] == 0  # no members, still reported
    assert s[("llmq_queue_depth", (("priority", "HIGH"),))] == 7
    assert s[("llmq_oldest_request_age_seconds", (("priority", "HIGH"),))] >= 0
    assert min(v for (name, _), v in s.items() if name == "kafka_consumergroup_lag") >= 0

    # A group committed past the end (e.g. a truncated topic) still shows lag 0, not negative.
    _commit(bootstrap, group, {(high, 0): 50})
    collector.refresh()
    assert _samples(build_registry(collector))[("kafka_consumergroup_lag", key(0))] == 0


def test_kafka_exporter_topic_broker_and_offset_sum_series_fill_dashboard_7589(settings):
    bootstrap = settings.kafka.bootstrap
    high = settings.topics.request_topic(Priority.HIGH)
    group = f"llmq-{settings.topics.prefix}-parity"
    _produce(bootstrap, high, 0, 10)
    _produce(bootstrap, high, 1, 4)
    _commit(bootstrap, group, {(high, 0): 7, (high, 1): 1})
    collector = LagCollector(LagReader(settings, group_pattern=f"^{group}$"), interval_s=60)
    assert collector.refresh()
    s = _samples(build_registry(collector))
    assert s[("kafka_brokers", ())] == 1
    topic = lambda t: (("topic", t),)  # noqa: E731
    assert s[("kafka_topic_partitions", topic(high))] == settings.topics.request_partitions
    # The pipeline's own topics, consumed or not ("messages produced per second" for each).
    assert s[("kafka_topic_partitions", topic(settings.topics.responses))] == settings.topics.response_partitions
    assert s[("kafka_topic_partitions", topic(settings.topics.dlq))] == settings.topics.dlq_partitions
    assert ("kafka_topic_partition_current_offset", (("partition", "0"), ("topic", settings.topics.dlq))) in s
    part = lambda p: (("partition", str(p)), ("topic", high))  # noqa: E731
    assert [s[("kafka_topic_partition_oldest_offset", part(p))] for p in range(3)] == [0, 0, 0]
    g = ("consumergroup", group)
    assert s[("kafka_consumergroup_current_offset_sum", (g, ("topic", high)))] == 8

    # What retention (here: a records deletion) removed is neither oldest offset nor lag any more.
    admin = AdminClient(settings.kafka.admin_config())
    for fut in admin.delete_records([TopicPartition(high, 1, 3)]).values():
        fut.result(30)
    _commit(bootstrap, group, {(high, 0): 9})
    assert collector.refresh()
    s = _samples(build_registry(collector))
    assert s[("kafka_topic_partition_oldest_offset", part(1))] == 3
    assert s[("kafka_consumergroup_lag", (g, *part(1)))] == 1  # committed 1, deleted up to 3, end 4
    assert s[("kafka_consumergroup_current_offset_sum", (g, ("topic", high)))] == 10
    assert s[("kafka_consumergroup_lag_sum", (g, ("topic", high)))] == 1 + 1

    # And as Prometheus reads them: kafka_exporter's names, typed gauges.
    port = free_port()
    serve(build_registry(collector), port)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in ("kafka_brokers", "kafka_topic_partitions", "kafka_topic_partition_oldest_offset",
                 "kafka_consumergroup_current_offset_sum"):
        assert f"# TYPE {name} gauge" in body, name
    assert "kafka_brokers 1.0" in body
    assert f'kafka_consumergroup_current_offset_sum{{consumergroup="{group}",topic="{high}"}} 10.0' in body


def test_time_lag_is_the_age_of_the_oldest_unconsumed_message(settings):
    bootstrap = settings.kafka.bootstrap
    low = settings.topics.request_topic(Priority.LOW)
    group = f"llmq-{settings.topics.prefix}-age"
    _produce(bootstrap, low, 0, 1)
    _commit(bootstrap, group, {(low, 0): 0})
    time.sleep(2.0)
    _produce(bootstrap, low, 0, 1)
    snap = LagReader(settings, group_pattern=f"^{group}$").snapshot()
    (part,) = [p for p in snap.partitions if p.topic == low and p.partition == 0]
    assert part.lag == 2
    assert 2.0 <= part.time_lag_s(snap.taken_at_ms) < 10.0


def test_scrapes_are_served_from_cache_fast_with_5_groups_8_topics_12_partitions(bootstrap):
    settings = make_settings(bootstrap)
    admin = AdminClient(settings.kafka.admin_config())
    topics = [f"{settings.topics.prefix}.scale.{i}" for i in range(8)]
    for fut in admin.create_topics([NewTopic(t, 12, 1) for t in topics]).values():
        fut.result(30)
    groups = [f"llmq-{settings.topics.prefix}-g{i}" for i in range(5)]
    for g in groups:
        _commit(bootstrap, g, {(t, p): 0 for t in topics for p in range(12)})
    reader = LagReader(settings, group_pattern=f"^llmq-{settings.topics.prefix}-g")
    collector = LagCollector(reader, interval_s=3600).start()
    try:
        assert collector.wait_ready(30)
        trips_after_first_refresh = reader.round_trips
        port = free_port()
        serve(build_registry(collector), port)
        url = f"http://127.0.0.1:{port}/metrics"
        durations = []
        for _ in range(30):  # a scraper far faster than the refresh interval
            started = time.perf_counter()
            body = urllib.request.urlopen(url, timeout=5).read().decode()
            durations.append(time.perf_counter() - started)
        assert body.count("kafka_consumergroup_lag{") == 5 * 8 * 12
        durations.sort()
        print(f"\nscrape of {5 * 8 * 12} partitions: median {durations[15] * 1000:.1f} ms, "
              f"max {durations[-1] * 1000:.1f} ms; admin round trips {reader.round_trips}")
        assert durations[15] < 0.05
        assert reader.round_trips == trips_after_first_refresh  # 30 scrapes, no admin request
    finally:
        collector.stop()
