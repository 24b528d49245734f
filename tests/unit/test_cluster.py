"""The local cluster's layout and each node's replication settings, without starting a JVM."""

from __future__ import annotations

import pytest

from pipeline.broker import LocalBroker, NodeRole
from pipeline.cluster import LocalCluster
from pipeline.config import Settings
from pipeline.config.topics import min_insync_replicas
from pipeline.errors import BrokerError, ConfigError
from pipeline.topics import pipeline_topics


def test_nodes_share_a_cluster_id_and_a_static_quorum_on_consecutive_ports(tmp_path):
    cluster = LocalCluster(3, 19092, tmp_path / "c")
    nodes = list(cluster.nodes.values())
    assert [b.port for b in nodes] == [19092, 19093, 19094]
    assert cluster.bootstrap == "127.0.0.1:19092,127.0.0.1:19093,127.0.0.1:19094"
    roles = [b.node for b in nodes]
    assert len({r.cluster_id for r in roles}) == 1 and len({r.voters for r in roles}) == 1
    assert roles[0].voters.count("@127.0.0.1:") == 3
    assert {r.controller_port for r in roles}.isdisjoint({19092, 19093, 19094})
    # The layout is kept: the same data dir is the same cluster.
    again = LocalCluster.at(tmp_path / "c")
    assert [b.node for b in again.nodes.values()] == roles
    with pytest.raises(BrokerError, match="3-node cluster"):
        LocalCluster(5, 19092, tmp_path / "c")


def test_a_node_config_replicates_internal_topics_to_a_majority(tmp_path):
    cluster = LocalCluster(3, 19092, tmp_path / "c")
    node = cluster.nodes[2]
    node.data_dir.mkdir(parents=True)
    node.write_config(node.node.controller_port)
    props = dict(line.split("=", 1) for line in node.properties.read_text().splitlines())
    assert props["node.id"] == "2"
    assert props["controller.quorum.voters"] == node.node.voters
    assert props["offsets.topic.replication.factor"] == "3"
    assert props["transaction.state.log.min.isr"] == "2" and props["min.insync.replicas"] == "2"


def test_a_single_broker_keeps_replication_one(tmp_path):
    broker = LocalBroker(19092, tmp_path / "b")
    broker.data_dir.mkdir(parents=True)
    broker.write_config(19093)
    props = dict(line.split("=", 1) for line in broker.properties.read_text().splitlines())
    assert props["offsets.topic.replication.factor"] == "1" and "min.insync.replicas" not in props
    assert NodeRole().replicas == 1


def test_min_insync_replicas_is_a_majority_short_of_all():
    assert [min_insync_replicas(rf) for rf in (1, 2, 3, 5)] == [1, 1, 2, 2]


def test_replicated_topics_carry_min_insync_replicas_unless_a_topic_sets_its_own():
    settings = Settings.load(env={})
    assert all("min.insync.replicas" not in s.config for s in pipeline_topics(settings))
    settings.topics.replication_factor = 3
    settings.topics.response_config = {**settings.topics.response_config, "min.insync.replicas": "3"}
    specs = {s.name: s for s in pipeline_topics(settings)}
    assert specs["llm.requests.critical"].config["min.insync.replicas"] == "2"
    assert specs["llm.responses"].config["min.insync.replicas"] == "3"
    settings.topics.min_insync_replicas = 4
    with pytest.raises(ConfigError, match="min_insync_replicas"):
        settings.topics.validate()
