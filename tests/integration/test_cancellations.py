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
