from pipeline.worker.membership import group_session_configs


def test_the_group_heartbeat_is_a_third_of_the_session():
    assert group_session_configs(6_000) == {"consumer.session.timeout.ms": "6000",
                                            "consumer.heartbeat.interval.ms": "2000"}


def test_the_group_heartbeat_never_exceeds_the_brokers_default():
    assert group_session_configs(45_000)["consumer.heartbeat.interval.ms"] == "5000"
