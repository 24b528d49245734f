"""The backend a worker's settings ask for."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import WorkerSettings
from pipeline.worker.backends.base import Backend


def make_backend(cfg: WorkerSettings) -> Backend:
    if cfg.backend == "openai":
        from pipeline.worker.backends.openai_http import OpenAIBackend

        key = Path(cfg.openai_api_key_file).expanduser().read_text().strip() if cfg.openai_api_key_file \
            else cfg.openai_api_key
        return OpenAIBackend(cfg.openai_base_url, key, timeout_s=cfg.backend_timeout_s,
                             max_attempts=cfg.backend_max_attempts, max_connections=max(8, cfg.max_inflight))
    from pipeline.worker.backends.simulated import SimulatedBackend

    return SimulatedBackend(cfg.sim_latency_ms, cfg.sim_ms_per_token)
