"""librdkafka's lines through Python logging: the rate limiter, and a real client without a broker."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from pipeline import kafka_log
from pipeline.config import Settings
from pipeline.kafka_log import ConnectionNoiseFilter

REFUSED = ("[thrd:127.0.0.1:9/bootstrap]: 127.0.0.1:9/bootstrap: Connect to ipv4#127.0.0.1:9 failed: "
           "Connection refused (after 0ms in state CONNECT)")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    @property
    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@pytest.fixture
def setup():
    """A private logger with the filter and a collecting handler, as confluent-kafka calls it."""
    logger = logging.getLogger(f"test.kafka_log.{time.monotonic_ns()}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    clock = Clock()
    flt = ConnectionNoiseFilter(30.0, clock=clock, logger=logger)
    logger.addFilter(flt)
    out = Collect()
    logger.addHandler(out)
    return logger, flt, clock, out


def rdkafka(logger, level, fac, text, client="rdkafka#consumer-1"):
    # confluent-kafka's own call: Logger.log(level, "%s [%s] %s", facility, name, text)
    logger.log(level, "%s [%s] %s", fac, client, text)


def test_the_first_refusal_is_one_warning_and_repeats_are_counted_into_a_summary(setup):
    logger, flt, clock, out = setup
    rdkafka(logger, logging.ERROR, "FAIL", REFUSED)
    assert len(out.records) == 1
    first = out.records[0]
    assert first.levelno == logging.WARNING
    assert "Connection refused" in first.getMessage() and "thrd:" not in first.getMessage()
    assert "after 0ms" not in first.getMessage()
    for i in range(119):
        clock.now += 0.2
        rdkafka(logger, logging.ERROR, "FAIL", REFUSED.replace("after 0ms", f"after {i}ms"),
                client="rdkafka#producer-2" if i % 2 else "rdkafka#consumer-1")
    assert len(out.records) == 1  # 23.8 s of repeats: nothing more yet
    clock.now += 10
    rdkafka(logger, logging.ERROR, "FAIL", REFUSED)
    assert len(out.records) == 2
    summary = out.records[1]
    assert summary.levelno == logging.WARNING
    assert "repeated 120 times in the last 34 s" in summary.getMessage()
    assert "rdkafka#consumer-1" in summary.getMessage() and "rdkafka#producer-2" in summary.getMessage()


def test_librdkafka_counts_of_identical_errors_it_suppressed_itself_are_added(setup):
    logger, flt, clock, out = setup
    rdkafka(logger, logging.ERROR, "FAIL", REFUSED)
    rdkafka(logger, logging.ERROR, "FAIL",
            REFUSED.replace("in state CONNECT)", "in state CONNECT, 4 identical error(s) suppressed)"))
    flt.flush()
    assert "repeated 5 more times" in out.lines[-1]


def test_a_failure_that_comes_back_after_a_quiet_interval_is_new_again(setup):
    logger, flt, clock, out = setup
    rdkafka(logger, logging.ERROR, "FAIL", REFUSED)
    clock.now += 31
    rdkafka(logger, logging.ERROR, "FAIL", REFUSED)
    assert len(out.records) == 2
    assert "repeats are summarised" in out.lines[1] and "repeated" not in out.lines[1]


def test_each_broker_and_kind_of_failure_is_its_own_line(setup):
    logger, flt, clock, out = setup
    rdkafka(logger, logging.ERROR, "FAIL", REFUSED)
    rdkafka(logger, logging.ERROR, "FAIL", REFUSED.replace("127.0.0.1:9", "127.0.0.1:10"))
    rdkafka(logger, logging.INFO, "FAIL", "[thrd:127.0.0.1:9/1]: 127.0.0.1:9/1: Disconnected (after 512ms in state UP)")
    rdkafka(logger, logging.INFO, "FAIL", "[thrd:127.0.0.1:9/1]: 127.0.0.1:9/1: Disconnected (after 9ms in state UP)")
    assert len(out.records) == 3
    assert all(r.levelno == logging.WARNING for r in out.records)
    assert "Disconnected" in out.lines[2]


def test_flush_reports_repeats_not_yet_summarised_and_nothing_when_there_are_none(setup):
    logger, flt, clock, out = setup
    flt.flush()
    assert out.records == []
    rdkafka(logger, logging.ERROR, "FAIL", REFUSED)
    clock.now += 5
    rdkafka(logger, logging.ERROR, "FAIL", REFUSED)
    rdkafka(logger, logging.ERROR, "FAIL", REFUSED)
    flt.flush()
    assert len(out.records) == 2 and "repeated 2 times in the last 5 s" in out.lines[1]
    flt.flush()
    assert len(out.records) == 2


def test_other_librdkafka_lines_keep_their_level_and_lose_the_thread_tag(setup):
    logger, flt, clock, out = setup
    rdkafka(logger, logging.INFO, "CONFWARN", "[thrd:app]: Configuration property x is a consumer property")
    rdkafka(logger, logging.INFO, "CONFWARN", "[thrd:app]: Configuration property x is a consumer property")
    assert [r.levelno for r in out.records] == [logging.INFO, logging.INFO]
    assert out.lines[0] == "rdkafka#consumer-1 CONFWARN: Configuration property x is a consumer property"
    logger.warning("not from librdkafka: %s", "kept as it is")
    assert out.lines[-1] == "not from librdkafka: kept as it is"


def test_install_attaches_one_filter_however_often_it_is_called():
    logger = logging.getLogger(kafka_log.LOGGER_NAME)
    before = list(logger.filters)
    try:
        a = kafka_log.install()
        b = kafka_log.install()
        assert a is b
        assert sum(isinstance(f, ConnectionNoiseFilter) for f in logger.filters) == 1
    finally:
        logger.filters[:] = before


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_consumer_pointed_at_a_closed_port_logs_through_python_logging(capfd):
    """A real librdkafka client: its connection failures arrive as records of pipeline.kafka
    (rate-limited by the installed filter), and nothing raw reaches stderr."""
    from confluent_kafka import Consumer

    settings = Settings.load(env={})
    settings.kafka.bootstrap = f"127.0.0.1:{_closed_port()}"
    logger = logging.getLogger(kafka_log.LOGGER_NAME)
    before_filters, before_level = list(logger.filters), logger.level
    out = Collect()
    logger.addHandler(out)
    logger.setLevel(logging.DEBUG)
    kafka_log.install()
    conf = settings.kafka.consumer_config("llmq-test-closed-port", **{
        "reconnect.backoff.ms": 10, "reconnect.backoff.max.ms": 20})
    assert conf["logger"] is logger
    consumer = Consumer(conf)
    try:
        consumer.subscribe(["llmq-test-nowhere"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not out.records:
            consumer.poll(0.2)
        for _ in range(5):  # a second's worth of retries more, every 10-20 ms
            consumer.poll(0.2)
    finally:
        consumer.close()
        logger.removeHandler(out)
        logger.filters[:] = before_filters
        logger.setLevel(before_level)
    refused = [r for r in out.records if "Connection refused" in r.getMessage()]
    assert len(refused) == 1, out.lines  # dozens of attempts, one line
    assert refused[0].levelno == logging.WARNING and refused[0].name == kafka_log.LOGGER_NAME
    err = capfd.readouterr().err
    assert "|FAIL|" not in err and "%3|" not in err
