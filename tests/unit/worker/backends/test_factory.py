"""make_backend: the worker's settings to a backend."""

from __future__ import annotations

import asyncio
import dataclasses

from pipeline.config import WorkerSettings
from pipeline.worker.backends.factory import make_backend
from pipeline.worker.backends.openai_http import OpenAIBackend
from pipeline.worker.backends.simulated import SimulatedBackend


def test_the_simulated_backend_is_the_default():
    assert isinstance(make_backend(WorkerSettings()), SimulatedBackend)


def test_one_base_url_serves_every_model_paced_within_max_inflight():
    cfg = dataclasses.replace(WorkerSettings(), backend="openai", openai_base_url="http://127.0.0.1:9/v1",
                              max_inflight=16)
    backend = make_backend(cfg)
    try:
        assert isinstance(backend, OpenAIBackend)
        assert [s.base_url for s in backend.routes.servers_for("any-model")] == ["http://127.0.0.1:9/v1"]
        assert backend.gate.config.adaptive and backend.gate.config.max_limit == 16
        assert backend.capacity("any-model") == 4
    finally:
        asyncio.run(backend.close())
