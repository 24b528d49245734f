"""The backend a worker's settings ask for."""

from __future__ import annotations

from pipeline.config import ModelSettings, WorkerSettings
from pipeline.worker.backends.base import Backend


def make_backend(cfg: WorkerSettings, models: ModelSettings | None = None) -> Backend:
    """``models``: the aliases and default model (``[models]``) the routing table applies."""
    if cfg.backend == "openai":
        from pipeline.worker.backends.affinity import AffinityConfig
        from pipeline.worker.backends.openai_http import OpenAIBackend
        from pipeline.worker.backends.pacing import PacingConfig
        from pipeline.worker.backends.routing import RoutingTable

        key = cfg.api_key()
        max_connections = max(8, cfg.max_inflight)
        names = {"aliases": models.aliases, "default": models.default} if models is not None else {}
        routes = RoutingTable.parse(cfg.openai_routes, **names) if cfg.openai_routes.strip() \
            else RoutingTable.single(cfg.openai_base_url, **names)
        pacing = None
        if cfg.backend_pacing:
            pacing = PacingConfig(initial_limit=min(cfg.backend_initial_inflight, max_connections),
                                  max_limit=max_connections,
                                  metrics_interval_s=cfg.backend_metrics_interval_ms / 1000.0,
                                  metrics_stale_s=cfg.backend_metrics_stale_ms / 1000.0)
        affinity = AffinityConfig(enabled=cfg.backend_prefix_affinity, epsilon=cfg.backend_affinity_epsilon,
                                  bound_floor=cfg.backend_affinity_bound_floor,
                                  wait_s=cfg.backend_affinity_wait_ms / 1000.0,
                                  block_chars=cfg.backend_affinity_block_chars,
                                  index_blocks=cfg.backend_affinity_index_blocks, ttl_s=cfg.backend_affinity_ttl_s)
        return OpenAIBackend(routes=routes, affinity=affinity, api_key=key, timeout_s=cfg.backend_timeout_s,
                             max_attempts=cfg.backend_max_attempts, max_connections=max_connections, pacing=pacing,
                             stream_completions=cfg.backend_stream, prefer_real_usage=cfg.backend_prefer_real_usage)
    from pipeline.worker.backends.simulated import SimulatedBackend

    return SimulatedBackend(cfg.sim_latency_ms, cfg.sim_ms_per_token)
