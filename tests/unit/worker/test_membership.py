from pipeline.worker.membership import group_session_configs


def test_the_group_heartbeat_is_a_third_of_the_session():
    assert group_session_configs(6_000) == {"consumer.session.timeout.ms": "6000",
                                            "consumer.heartbeat.interval.ms": "2000"}


def test_a_long_session_keeps_the_brokers_heartbeat():
    # Heartbeats carry assignments: a 15 s session's 5 s heartbeat made joins wait 5 s on a broker
    # whose own default is 1 s.
    assert group_session_configs(45_000) == {"consumer.session.timeout.ms": "45000",
                                             "consumer.heartbeat.interval.ms": None}
    assert group_session_configs(15_000)["consumer.heartbeat.interval.ms"] is None


def test_static_membership_without_a_stable_worker_id_is_refused_naming_the_key():
    import pytest

    from pipeline.config import Settings
    from pipeline.errors import ConfigError
    from pipeline.worker.backends.simulated import SimulatedBackend
    from pipeline.worker.loop import Worker

    settings = Settings.load(env={"LLMQ_WORKER__STATIC_MEMBERSHIP": "true"})
    with pytest.raises(ConfigError) as info:
        Worker(settings, SimulatedBackend())
    assert info.value.key == "worker.worker_id"
    assert Worker(settings, SimulatedBackend(), worker_id="pod-7").worker_id == "pod-7"
