"""Local broker helpers that need no broker."""

from __future__ import annotations

import uuid
from unittest import mock

from pipeline.broker import new_cluster_id


def test_a_cluster_id_never_starts_with_a_dash_which_the_storage_tool_reads_as_an_option():
    # 0xfb... encodes to "-..." in URL-safe base64: the first draw must be skipped.
    dash_first = uuid.UUID(bytes=b"\xfb" + bytes(15))
    with mock.patch("pipeline.broker.uuid.uuid4", side_effect=[dash_first, uuid.UUID(int=1)]):
        cid = new_cluster_id()
    assert not cid.startswith("-") and len(cid) == 22


def test_cluster_ids_are_random():
    assert len({new_cluster_id() for _ in range(100)}) == 100


def test_the_broker_settings_default_jvm_options_are_the_local_brokers():
    from pipeline.broker import DEFAULT_JVM_OPTIONS, LocalBroker
    from pipeline.config import Settings

    assert Settings().broker.jvm_options == DEFAULT_JVM_OPTIONS
    assert LocalBroker(9092, "/tmp/unused").jvm_options == DEFAULT_JVM_OPTIONS.split()
    assert LocalBroker(9092, "/tmp/unused", jvm_options="-XX:+UseParallelGC -Dx=1").jvm_options == [
        "-XX:+UseParallelGC", "-Dx=1"]


def test_the_local_broker_runs_g1_unless_its_jvm_options_choose_a_collector():
    from pipeline.broker import LocalBroker

    assert "-XX:+UseG1GC" in LocalBroker(9092, "/tmp/unused").memory_options()
    chosen = LocalBroker(9092, "/tmp/unused", jvm_options="-XX:+UseShenandoahGC")
    assert not any(o.startswith("-XX:+Use") for o in chosen.memory_options())  # the JVM refuses two



def test_the_local_brokers_log_cleaner_keeps_a_small_dedupe_buffer(tmp_path):
    # Kafka's 128-MiB default is allocated at start and was most of a 1-GiB heap's old
    # generation: G1 then marked concurrently every few seconds under load.
    from pipeline.broker import LocalBroker

    broker = LocalBroker(9092, tmp_path)
    broker.write_config(controller_port=9093)
    props = dict(line.split("=", 1) for line in broker.properties.read_text().splitlines())
    assert int(props["log.cleaner.dedupe.buffer.size"]) == 16 * 1024 * 1024


def test_the_local_broker_has_its_whole_heap_from_the_start():
    from pipeline.broker import LocalBroker

    options = LocalBroker(9092, "/tmp/unused", heap="1g").memory_options()
    assert "-Xms1g" in options and "-Xmx1g" in options


def test_the_local_broker_purges_completed_delayed_fetches_often(tmp_path):
    # At Kafka's default (1,000) completed fetches stayed referenced long enough to be copied
    # and promoted by every young collection under a flood of fetches.
    from pipeline.broker import LocalBroker

    broker = LocalBroker(9092, tmp_path)
    broker.write_config(controller_port=9093)
    props = dict(line.split("=", 1) for line in broker.properties.read_text().splitlines())
    assert int(props["fetch.purgatory.purge.interval.requests"]) <= 10
    assert int(props["producer.purgatory.purge.interval.requests"]) <= 10
