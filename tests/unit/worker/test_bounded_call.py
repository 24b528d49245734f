"""Transactional calls run under a watchdog: librdkafka can ignore their timeout (librdkafka#5456)."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.worker.loop import _bounded_call, _CallHung


def test_returns_the_value_of_a_prompt_call():
    assert _bounded_call(lambda: 42, 1.0) == 42


def test_reraises_the_calls_own_error_on_the_caller_thread():
    def fails():
        raise ValueError("broker said no")

    with pytest.raises(ValueError, match="broker said no"):
        _bounded_call(fails, 1.0)


def test_a_call_that_never_returns_is_reported_not_waited_for():
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(_CallHung):
        _bounded_call(release.wait, 0.1)
    assert time.monotonic() - t0 < 5
    release.set()
