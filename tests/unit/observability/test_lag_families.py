"""The lag exporter's series against an admin client that answers from a script: kafka_exporter's
names and labels, lag never negative and only of what is still in the log, uncommitted partitions."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from confluent_kafka import TopicPartition
from confluent_kafka.admin import OffsetSpec

from pipeline.config import Settings
from pipeline.observability import lag

GROUP = "llmq-pool-realtime"


def done(value) -> Future:
    fut = Future()
    fut.set_result(value)
    return fut


class ScriptedAdmin:
    """One group on one topic of 3 partitions, 2 brokers; offsets as given."""

    def __init__(self, topic: str, committed: dict[int, int], end: dict[int, int], oldest: dict[int, int],
                 members: int = 1):
        self.topic, self.committed, self.end, self.oldest, self.members = topic, committed, end, oldest, members
        self.polled = 0

    def poll(self, timeout):
        self.polled += 1
        return 0

    def list_consumer_groups(self, request_timeout=None):
        return done(SimpleNamespace(valid=[SimpleNamespace(group_id=GROUP), SimpleNamespace(group_id="other")]))

    def describe_consumer_groups(self, names, request_timeout=None):
        member = SimpleNamespace(assignment=SimpleNamespace(topic_partitions=[TopicPartition(self.topic, 0)]))
        return {n: done(SimpleNamespace(members=[member] * self.members, state="ConsumerGroupState.STABLE"))
                for n in names}

    def list_consumer_group_offsets(self, requests, request_timeout=None):
        (req,) = requests
        tps = [TopicPartition(self.topic, p, o) for p, o in self.committed.items()]
        return {req.group_id: done(SimpleNamespace(topic_partitions=tps))}

    def list_topics(self, timeout=None):
        part = SimpleNamespace()
        topics = {self.topic: SimpleNamespace(partitions={0: part, 1: part, 2: part}, error=None),
                  "someone.elses": SimpleNamespace(partitions={0: part}, error=None)}
        return SimpleNamespace(topics=topics, brokers={1: object(), 2: object()})

    def list_offsets(self, request, request_timeout=None):
        earliest = type(OffsetSpec.earliest())
        out = {}
        for tp, spec in request.items():
            table = self.oldest if isinstance(spec, earliest) else self.end
            out[tp] = done(SimpleNamespace(offset=table.get(tp.partition, 0) if tp.topic == self.topic else 0))
        return out


def samples(admin) -> dict:
    settings = Settings.load(env={})
    reader = lag.LagReader(settings, group_pattern=f"^{GROUP}$", time_lag=False)
    reader.admin = admin
    collector = lag.LagCollector(reader)
    assert collector.refresh()
    registry = lag.build_registry(collector)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples}


def test_kafka_exporter_series_with_their_names_and_labels():
    settings = Settings.load(env={})
    high = settings.topics.request_topic(lag.Priority.HIGH)
    admin = ScriptedAdmin(high, committed={0: 7, 1: -1001}, end={0: 10, 1: 4, 2: 0}, oldest={0: 0, 1: 0, 2: 0})
    s = samples(admin)
    g = ("consumergroup", GROUP)
    assert s[("kafka_brokers", ())] == 2
    assert s[("kafka_topic_partitions", (("topic", high),))] == 3
    assert ("kafka_topic_partitions", (("topic", "someone.elses"),)) not in s  # neither a group's nor llmq's
    responses = settings.topics.responses
    assert ("kafka_topic_partitions", (("topic", responses),)) not in s  # not in this cluster's metadata
    assert s[("kafka_topic_partition_current_offset", (("partition", "0"), ("topic", high)))] == 10
    assert s[("kafka_topic_partition_oldest_offset", (("partition", "0"), ("topic", high)))] == 0
    assert s[("kafka_consumergroup_current_offset", (g, ("partition", "0"), ("topic", high)))] == 7
    assert ("kafka_consumergroup_current_offset", (g, ("partition", "1"), ("topic", high))) not in s
    assert s[("kafka_consumergroup_current_offset_sum", (g, ("topic", high)))] == 7  # committed partitions only
    assert s[("kafka_consumergroup_lag", (g, ("partition", "1"), ("topic", high)))] == 4  # never committed: all
    assert s[("kafka_consumergroup_lag_sum", (g, ("topic", high)))] == 3 + 4
    assert s[("llmq_consumergroup_uncommitted_partitions", (g, ("topic", high)))] == 1
    assert s[("kafka_consumergroup_members", (g,))] == 1
    assert admin.polled == 1  # librdkafka's log lines are served once per refresh


def test_lag_is_never_negative_and_counts_only_what_retention_kept():
    settings = Settings.load(env={})
    low = settings.topics.request_topic(lag.Priority.LOW)
    # p0 committed past the end (a truncated log), p1 committed below what retention deleted,
    # p2 never committed, its first 40 messages deleted.
    admin = ScriptedAdmin(low, committed={0: 50, 1: 3, 2: -1001}, end={0: 10, 1: 100, 2: 60},
                          oldest={0: 0, 1: 90, 2: 40})
    s = samples(admin)
    g = ("consumergroup", GROUP)
    lags = {labels[1][1]: v for (name, labels), v in s.items() if name == "kafka_consumergroup_lag"}
    assert lags == {"0": 0, "1": 10, "2": 20}
    assert s[("kafka_consumergroup_current_offset_sum", (g, ("topic", low)))] == 53
    assert s[("kafka_topic_partition_oldest_offset", (("partition", "1"), ("topic", low)))] == 90


def test_assigned_topics_a_group_never_commits_count_as_lag_only_when_they_are_work_topics():
    # A gateway's members are assigned its table changelogs too (standbys, recovery); Faust reads
    # them by position and never commits there, so they are not a backlog.
    committed: dict = {("gw", "llm.requests.high", 0): 5}
    groups = {"gw": lag.GroupInfo("gw", "STABLE", 2, {"llm.requests.high": 2, "llm.responses": 2,
                                                      "gw-seen-changelog": 2, "gw-__assignor-__leader": 1})}
    topics = {"llm.requests.high": [0, 1], "llm.responses": [0, 1], "gw-seen-changelog": [0, 1],
              "gw-__assignor-__leader": [0]}
    lag.LagReader.add_uncommitted(committed, groups, topics, {"llm.requests.high", "llm.responses"})
    assert committed == {("gw", "llm.requests.high", 0): 5, ("gw", "llm.requests.high", 1): None,
                         ("gw", "llm.responses", 0): None, ("gw", "llm.responses", 1): None}
