"""A cancellation view started before its topic exists starts reading once the topic is created."""

import time

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from pipeline.cancellations import CancellationView, cancellation_record
from pipeline.topics import TopicSpec, ensure_topics
from tests.integration.harness import make_settings


def test_a_view_started_before_its_topic_exists_reads_it_once_created(bootstrap):
    settings = make_settings(bootstrap)  # nothing created: the topic is missing
    view = CancellationView(settings, retry_s=0.2)
    try:
        assert not view.active and view.poll() == []
        ensure_topics(AdminClient(settings.kafka.admin_config()),
                      [TopicSpec(settings.topics.cancellations, 1, 1, {"cleanup.policy": "compact"})])
        producer = Producer(settings.kafka.producer_config())
        key, value = cancellation_record("req-late", "user closed the tab")
        producer.produce(settings.topics.cancellations, value, key)
        assert producer.flush(10) == 0
        deadline = time.monotonic() + 30
        seen = []
        while not seen and time.monotonic() < deadline:
            seen = view.poll()
            time.sleep(0.05)
        assert view.active
        assert seen == ["req-late"] and view.reason("req-late") == "user closed the tab"
    finally:
        view.close()


def test_a_view_caught_up_knows_every_cancellation_written_before_it_started(settings):
    # A worker starting (after its predecessor died) decides nothing before this: a request its
    # predecessor answered CANCELLED must not run for want of its cancellation read.
    producer = Producer(settings.kafka.producer_config())
    ids = [f"req-{i}" for i in range(3000)]
    for rid in ids:
        key, value = cancellation_record(rid, f"withdrawn {rid}")
        producer.produce(settings.topics.cancellations, value, key)
        producer.poll(0)
    assert producer.flush(30) == 0
    view = CancellationView(settings)
    try:
        assert view.catch_up(timeout_s=30)
        assert all(view.reason(rid) == f"withdrawn {rid}" for rid in ids)
        assert view.catch_up(timeout_s=5)  # nothing new: at the end already
    finally:
        view.close()
    missing = CancellationView(make_settings(settings.kafka.bootstrap), retry_s=60)  # no topic
    try:
        assert not missing.catch_up(timeout_s=1)
    finally:
        missing.close()
