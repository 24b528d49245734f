"""[worker]'s backend settings: routes, pacing, streaming; each error names its key."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import pytest

from pipeline.config import Settings, WorkerSettings
from pipeline.errors import ConfigError
from pipeline.worker.backends.factory import make_backend

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("env, key", [
    ({"LLMQ_WORKER__OPENAI_ROUTES": "big"}, "worker.openai_routes"),
    ({"LLMQ_WORKER__OPENAI_ROUTES": "big=ftp://host/v1"}, "worker.openai_routes"),
    ({"LLMQ_WORKER__OPENAI_ROUTES": "=http://host/v1"}, "worker.openai_routes"),
    ({"LLMQ_WORKER__OPENAI_ROUTES": "big=;*=http://host/v1"}, "worker.openai_routes"),
    ({"LLMQ_WORKER__BACKEND_INITIAL_INFLIGHT": "0"}, "worker.backend_initial_inflight"),
    ({"LLMQ_WORKER__BACKEND_METRICS_INTERVAL_MS": "0"}, "worker.backend_metrics_interval_ms"),
    ({"LLMQ_WORKER__BACKEND_METRICS_STALE_MS": "50"}, "worker.backend_metrics_stale_ms"),
    ({"LLMQ_WORKER__BACKEND_PACING": "maybe"}, "LLMQ_WORKER__BACKEND_PACING"),
])
def test_a_bad_backend_setting_is_refused_naming_its_key(env, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Settings.load(env=env)


def test_routes_from_the_environment_reach_the_backend():
    s = Settings.load(env={"LLMQ_WORKER__BACKEND": "openai",
                           "LLMQ_WORKER__OPENAI_ROUTES": "big=http://a:8000/v1,http://b:8000/v1; *=http://c:8000/v1",
                           "LLMQ_WORKER__BACKEND_PACING": "false", "LLMQ_WORKER__MAX_INFLIGHT": "16"})
    backend = make_backend(s.worker)
    try:
        assert [x.base_url for x in backend.routes.servers_for("big")] == ["http://a:8000/v1", "http://b:8000/v1"]
        assert [x.base_url for x in backend.routes.servers_for("small")] == ["http://c:8000/v1"]
        assert not backend.gate.config.adaptive and backend.capacity("big") == 32
    finally:
        asyncio.run(backend.close())


def test_pacing_settings_reach_the_gate():
    s = Settings.load(env={"LLMQ_WORKER__BACKEND": "openai", "LLMQ_WORKER__BACKEND_INITIAL_INFLIGHT": "2",
                           "LLMQ_WORKER__BACKEND_METRICS_INTERVAL_MS": "20",
                           "LLMQ_WORKER__BACKEND_METRICS_STALE_MS": "100",
                           "LLMQ_WORKER__BACKEND_STREAM": "false"})
    backend = make_backend(s.worker)
    try:
        cfg = backend.gate.config
        assert (cfg.initial_limit, cfg.metrics_interval_s, cfg.metrics_stale_s) == (2, 0.02, 0.1)
        assert backend.stream_completions is False and backend.room() == 2
    finally:
        asyncio.run(backend.close())


def test_the_deployed_config_lists_every_backend_setting_with_its_default():
    worker = tomllib.loads((ROOT / "deploy" / "llmq.toml").read_text())["worker"]
    defaults = WorkerSettings()
    for key in ("openai_routes", "backend_pacing", "backend_initial_inflight", "backend_metrics_interval_ms",
                "backend_metrics_stale_ms", "backend_stream", "backend_prefer_real_usage"):
        assert worker[key] == getattr(defaults, key), key


def test_a_missing_api_key_file_is_a_config_error_naming_the_setting_not_the_path(tmp_path):
    from pipeline.errors import ConfigError

    s = Settings.load(env={})
    s.worker.backend, s.worker.openai_api_key_file = "openai", str(tmp_path / "secret" / "model.key")
    with pytest.raises(ConfigError) as err:
        make_backend(s.worker)
    assert err.value.key == "worker.openai_api_key_file" and str(tmp_path) not in str(err.value)
    (tmp_path / "model.key").write_text("sk-123\n")
    s.worker.openai_api_key_file = str(tmp_path / "model.key")
    assert s.worker.api_key() == "sk-123"
