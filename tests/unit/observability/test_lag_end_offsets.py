"""The lag reader asks again for a partition whose leader is moving, instead of failing the refresh."""

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException

from pipeline.config import Settings
from pipeline.observability import lag


def _future(value=None, error=None) -> Future:
    fut = Future()
    if error is not None:
        fut.set_exception(KafkaException(KafkaError(error)))
    else:
        fut.set_result(SimpleNamespace(offset=value))
    return fut


class Err:
    def __init__(self, code):
        self.code = code


class FakeAdmin:
    """list_offsets answers from a script: one dict {(topic, partition): offset or Err} per call."""

    def __init__(self, script):
        self.script, self.asked = list(script), []

    def list_offsets(self, request, request_timeout=None):
        answers = self.script.pop(0)
        self.asked.append(sorted((tp.topic, tp.partition) for tp in request))
        return {tp: _future(error=a.code) if isinstance(a, Err) else _future(a)
                for tp, a in ((tp, answers[(tp.topic, tp.partition)]) for tp in request)}


def _reader(monkeypatch, script) -> lag.LagReader:
    monkeypatch.setattr(lag.time, "sleep", lambda s: None)
    reader = lag.LagReader(Settings.load(env={}))
    reader.admin = FakeAdmin(script)
    return reader


def test_a_partition_without_a_leader_yet_is_asked_again(monkeypatch):
    moving = Err(KafkaError.NOT_LEADER_FOR_PARTITION)
    reader = _reader(monkeypatch, [{("t", 0): 3, ("t", 1): moving}, {("t", 1): 6}])
    assert reader.end_offsets({("t", 0), ("t", 1)}) == {("t", 0): 3, ("t", 1): 6}
    assert reader.admin.asked == [[("t", 0), ("t", 1)], [("t", 1)]]  # only the one that failed


def test_an_error_that_retrying_cannot_fix_fails_at_once(monkeypatch):
    reader = _reader(monkeypatch, [{("t", 0): Err(KafkaError.TOPIC_AUTHORIZATION_FAILED)}])
    with pytest.raises(KafkaException):
        reader.end_offsets({("t", 0)})
    assert len(reader.admin.asked) == 1


def test_a_leader_that_stays_away_fails_after_the_last_attempt(monkeypatch):
    moving = Err(KafkaError.LEADER_NOT_AVAILABLE)
    reader = _reader(monkeypatch, [{("t", 0): moving}] * 3)
    with pytest.raises(KafkaException):
        reader.end_offsets({("t", 0)})
    assert len(reader.admin.asked) == 3
