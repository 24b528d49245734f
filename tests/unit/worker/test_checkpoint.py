"""Transactional calls run under a watchdog: librdkafka can ignore their timeout (librdkafka#5456)."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.worker.checkpoint import CallHung, bounded_call


def test_returns_the_value_of_a_prompt_call():
    assert bounded_call(lambda: 42, 1.0) == 42


def test_reraises_the_calls_own_error_on_the_caller_thread():
    def fails():
        raise ValueError("broker said no")

    with pytest.raises(ValueError, match="broker said no"):
        bounded_call(fails, 1.0)


def test_a_call_that_never_returns_is_reported_not_waited_for():
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(CallHung):
        bounded_call(release.wait, 0.1)
    assert time.monotonic() - t0 < 5
    release.set()


def test_the_worker_stops_with_an_error_once_too_many_producers_are_abandoned(monkeypatch):
    from pipeline.config import Settings
    from pipeline.errors import KafkaOperationError
    from pipeline.worker import checkpoint, loop
    from pipeline.worker.backends.simulated import SimulatedBackend

    monkeypatch.setattr(checkpoint, "_ABANDONED_PRODUCERS", [])
    settings = Settings.load(env={})
    settings.worker.delivery = "exactly-once"
    worker = loop.Worker(settings, SimulatedBackend(), worker_id="stuck-txn")
    for n in range(1, checkpoint.MAX_ABANDONED_PRODUCERS + 1):
        worker.session.producer = object()  # stands in for a producer stuck in send_offsets_to_transaction
        worker.checkpoint.abandon_producer("the transaction commit")
        assert worker.producer is None and worker.session.restart
        assert (worker.session.fatal is None) == (n < checkpoint.MAX_ABANDONED_PRODUCERS)
    assert isinstance(worker.session.fatal, KafkaOperationError)
    assert "3 producers abandoned" in str(worker.session.fatal)


@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
def test_a_fatal_producer_error_ends_the_session_exactly_once_and_the_worker_at_least_once(delivery):
    from confluent_kafka import KafkaError

    from pipeline.testing import FakeMessage
    from tests.unit.worker.test_preemption import make_worker

    worker = make_worker(delivery=delivery)
    err = KafkaError(KafkaError.INVALID_TXN_STATE, "Failed to end transaction", fatal=True)
    msg = FakeMessage(worker.responses_topic, 0, -1, b"answer", b"tenant-a")
    worker.responder._not_delivered(err, msg, lambda *a: None, "llm.dispatch.normal[0]@7")
    if delivery == "exactly-once":
        # A transactional producer's fatal error: a new session with a new producer fences it.
        assert worker.session.restart and worker.session.fatal is None
    else:
        assert worker.session.fatal is not None and not worker.session.restart
