import pytest

from pipeline.config import Settings
from pipeline.errors import ConfigError
from pipeline.models import Priority


def test_defaults_render_safe_librdkafka_properties():
    s = Settings.load(env={})
    p = s.kafka.producer_config()
    assert p["bootstrap.servers"] == "127.0.0.1:9092"
    assert p["enable.idempotence"] is True and p["acks"] == "all"
    c = s.kafka.consumer_config("g")
    assert c["group.id"] == "g" and c["enable.auto.commit"] is False


def test_topic_names_follow_the_prefix():
    s = Settings.load(env={"LLMQ_TOPICS__PREFIX": "staging.llm"})
    assert s.topics.request_topic(Priority.CRITICAL) == "staging.llm.requests.critical"
    assert s.topics.responses == "staging.llm.responses"
    assert s.topics.dlq == "staging.llm.dlq"
    assert len(s.topics.request_topics) == 5


def test_file_then_environment_then_bootstrap_shortcut(tmp_path):
    f = tmp_path / "llmq.toml"
    f.write_text('[worker]\nmax_inflight = 8\n[kafka]\nbootstrap = "kafka:9092"\n'
                 '[kafka.properties]\n"linger.ms" = 20\n')
    s = Settings.load(f, env={"LLMQ_WORKER__MAX_INFLIGHT": "16", "LLMQ_RDKAFKA_FETCH_MIN_BYTES": "1024"})
    assert s.worker.max_inflight == 16
    assert s.kafka.bootstrap == "kafka:9092"
    assert s.kafka.producer_config()["linger.ms"] == 20
    assert s.kafka.consumer_config("g")["fetch.min.bytes"] == "1024"
    s2 = Settings.load(f, env={"LLMQ_BOOTSTRAP": "b:1", "LLMQ_CONFIG": "ignored-when-path-given"})
    assert s2.kafka.bootstrap == "b:1"


def test_passthrough_properties_win_over_llmq_defaults():
    s = Settings.load(env={"LLMQ_RDKAFKA_ACKS": "1"})
    assert s.kafka.producer_config()["acks"] == "1"


@pytest.mark.parametrize("env, key", [
    ({"LLMQ_WORKER__MAX_INFLIGHT": "0"}, "worker.max_inflight"),
    ({"LLMQ_WORKER__MAX_INFLIGHT": "lots"}, "LLMQ_WORKER__MAX_INFLIGHT"),
    ({"LLMQ_WORKER__NO_SUCH_KEY": "1"}, "LLMQ_WORKER__NO_SUCH_KEY"),
    ({"LLMQ_NOSECTION__X": "1"}, "LLMQ_NOSECTION__X"),
    ({"LLMQ_SERDE__WIRE_FORMAT": "confluent"}, "serde.registry_url"),
    ({"LLMQ_TOPICS__REQUEST_PARTITIONS": "-1"}, "topics.request_partitions"),
    ({"LLMQ_WORKER__GROUP_PROTOCOL": "eager"}, "worker.group_protocol"),
    ({"LLMQ_WORKER__GROUP_REMOTE_ASSIGNOR": ""}, "worker.group_remote_assignor"),
    ({"LLMQ_WORKER__PRODUCER_LINGER_MS": "-1"}, "worker.producer_linger_ms"),
])
def test_invalid_settings_are_refused_naming_the_key(env, key):
    with pytest.raises(ConfigError) as info:
        Settings.load(env=env)
    assert info.value.key == key
    assert key in str(info.value)


def test_unknown_keys_in_the_file_are_refused_naming_them(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[worker]\nmax_in_flight = 3\n")
    with pytest.raises(ConfigError, match="worker.max_in_flight"):
        Settings.load(f, env={})


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Settings.load(env={"LLMQ_CONFIG": str(tmp_path / "nope.toml")})


def test_example_config_in_deploy_is_valid():
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / "deploy" / "llmq.toml"
    Settings.load(example, env={})


def test_pools_pick_their_bands_and_their_own_group():
    s = Settings.load(env={"LLMQ_WORKER__POOL": "realtime"})
    assert s.topics.pool_topics("realtime") == ["llm.requests.critical", "llm.requests.high"]
    assert s.worker.effective_group_id() == "llmq-pool-realtime"
    explicit = Settings.load(env={"LLMQ_WORKER__POOL": "async", "LLMQ_WORKER__GROUP_ID": "mine"})
    assert explicit.worker.effective_group_id() == "mine"
    assert Settings.load(env={}).worker.effective_group_id() == "llmq-workers"
    with pytest.raises(ConfigError, match="worker.pool"):
        Settings.load(env={"LLMQ_WORKER__POOL": "turbo"})


def test_the_example_file_documents_every_gateway_default():
    from pathlib import Path

    example = Settings.load(Path(__file__).resolve().parents[3] / "deploy" / "llmq.toml", env={})
    assert example.gateway == Settings.load(env={}).gateway


@pytest.mark.parametrize("toml, key", [
    ("[gateway.limits.per_second]\nwindow_ms = 0\nrequests = 5", "gateway.limits.per_second.window_ms"),
    ("[gateway.limits.per_second]\nwindow_ms = 1000\nburst = 5", "gateway.limits.per_second"),
    ("[gateway.limits.per_second]\nwindow_ms = 1000\nper = 5", "gateway.limits.per_second.per"),
    ("[gateway.limits]\nper_second = 5", "gateway.limits.per_second"),
    ("[gateway.tenant_limits.acme.s]\nwindow_ms = 1000", "gateway.tenant_limits.acme.s"),
    ("[gateway.queue_caps]\nURGENT = 5", "gateway.queue_caps.URGENT"),
    ("[gateway.tenant_outstanding]\nHIGH = -1", "gateway.tenant_outstanding.HIGH"),
    ("[gateway.tier_offsets]\ngold = 'up'", "gateway.tier_offsets.gold"),
    ("[gateway]\ndemote_floor = 'LOWEST'", "gateway.demote_floor"),
    ("[gateway]\nhigh_load = 0", "gateway.high_load"),
    ("[gateway]\nstore = 'rocksdb://'", "gateway.store"),
    ("[gateway]\ntarget_queue_ms = 0", "gateway.target_queue_ms"),
    ("[worker]\nsource = 'topics'", "worker.source"),
    ("[gateway]\nsession_timeout_ms = 500", "gateway.session_timeout_ms"),
    ("[gateway]\ninstance_id = \"gw\\t0\"", "gateway.instance_id"),
    ("[gateway.shadow]\nhigh_load = 2", "gateway.shadow.high_load"),
    ("[gateway.shadow.limits.per_second]\nwindow_ms = 0\nrequests = 5", "gateway.shadow.limits.per_second.window_ms"),
    ("[gateway.shadow.queue_caps]\nURGENT = 5", "gateway.shadow.queue_caps.URGENT"),
    ("[gateway.shadow]\nqueue_caps = 5", "gateway.shadow.queue_caps"),
])
def test_invalid_gateway_settings_are_refused_naming_the_key(tmp_path, toml, key):
    f = tmp_path / "bad.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError) as exc:
        Settings.load(f, env={})
    assert exc.value.key == key


def test_a_shadow_policy_is_the_real_one_with_the_shadowed_keys_replaced(tmp_path):
    f = tmp_path / "shadow.toml"
    f.write_text("[gateway.shadow.limits]\nper_second = { window_ms = 1000, requests = 20 }\n"
                 "[gateway.shadow.queue_caps]\nNORMAL = 500\n")
    g = Settings.load(f, env={}).gateway
    assert Settings.load(env={}).gateway.shadow_policy() is None
    shadow = g.shadow_policy()
    assert [lim.requests for lim in shadow.rate_limits()[0]] == [20]
    assert shadow.queue_caps == {"NORMAL": 500} and shadow.tenant_outstanding == g.tenant_outstanding
    assert shadow.shadow == {} and g.rate_limits()[0][0].requests == 200


def test_workers_behind_the_gateway_consume_the_dispatch_topics():
    s = Settings.load(env={})
    assert s.topics.pool_topics("realtime", "dispatch") == ["llm.dispatch.critical", "llm.dispatch.high"]


def test_workers_use_the_consumer_group_protocol_with_the_range_assignor_by_default():
    s = Settings.load(env={})
    conf = s.kafka.consumer_config("g", **s.worker.membership_config("w1"))
    assert conf["group.protocol"] == "consumer" and conf["group.remote.assignor"] == "range"
    # librdkafka refuses the classic protocol's properties under the consumer protocol.
    assert "partition.assignment.strategy" not in conf and "session.timeout.ms" not in conf


def test_the_classic_group_protocol_keeps_the_client_side_session_timeout():
    s = Settings.load(env={"LLMQ_WORKER__GROUP_PROTOCOL": "classic", "LLMQ_WORKER__SESSION_TIMEOUT_MS": "6000"})
    conf = s.kafka.consumer_config("g", **s.worker.membership_config("w1"))
    assert conf["session.timeout.ms"] == 6000
    assert conf["partition.assignment.strategy"] == "cooperative-sticky"
    assert "group.protocol" not in conf


def test_a_none_override_removes_a_default_consumer_property():
    conf = Settings.load(env={}).kafka.consumer_config("g", **{"fetch.wait.max.ms": None})
    assert "fetch.wait.max.ms" not in conf


def test_static_membership_makes_the_worker_id_the_group_instance_id():
    s = Settings.load(env={"LLMQ_WORKER__STATIC_MEMBERSHIP": "true"})
    assert s.worker.membership_config("pod-7")["group.instance.id"] == "pod-7"
    assert "group.instance.id" not in Settings.load(env={}).worker.membership_config("pod-7")
