"""The simulated model: deterministic answers, configured latency, and a capped per-request override."""

from __future__ import annotations

import asyncio

from pipeline.models import Request
from pipeline.worker.backends.simulated import (LATENCY_METADATA_KEY, MAX_REQUESTED_LATENCY_MS, SimulatedBackend,
                                                expected_output)


def test_answers_depend_only_on_the_request():
    req = Request.new("t", "hello", max_tokens=4)
    assert SimulatedBackend().answer(req).output == expected_output(req)
    assert len(expected_output(req).split()) == 4


def test_zero_latency_answers_without_awaiting():
    assert SimulatedBackend().complete_now(Request.new("t", "x")) is not None
    assert SimulatedBackend(latency_ms=5).complete_now(Request.new("t", "x")) is None


def test_a_request_can_ask_for_its_own_latency_for_fault_injection():
    backend = SimulatedBackend(latency_ms=5)
    slow = Request.new("t", "x", metadata={LATENCY_METADATA_KEY: "15000"})
    assert backend.delay_s(slow) == 15.0
    assert SimulatedBackend().complete_now(slow) is None  # even a 0-ms model honours it


def test_requested_latency_is_capped_and_garbage_is_ignored():
    backend = SimulatedBackend(latency_ms=5)
    huge = Request.new("t", "x", metadata={LATENCY_METADATA_KEY: "1e12"})
    assert backend.delay_s(huge) == MAX_REQUESTED_LATENCY_MS / 1000
    for bad in ("nan", "-3", "soon"):
        assert backend.delay_s(Request.new("t", "x", metadata={LATENCY_METADATA_KEY: bad})) == 0.005


def test_complete_sleeps_the_requested_time():
    req = Request.new("t", "x", metadata={LATENCY_METADATA_KEY: "30"})
    completion = asyncio.run(SimulatedBackend().complete(req))
    assert completion.output == expected_output(req)
