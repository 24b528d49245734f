"""The worker's word on which models its pool serves: read from its servers, published to the catalog.

At start and every ``models.refresh_s`` the worker asks its backend what its servers list on
``/v1/models`` (:class:`~pipeline.worker.backends.base.CatalogedBackend`) and publishes the
pool's :class:`~pipeline.catalog.catalog.PoolModels` to ``<prefix>.models``. Every worker of a
pool writes the same record (keyed by the pool's group), so the catalog holds one list per pool.
A publish that fails is logged and tried again at the next refresh: serving goes on regardless.
"""

from __future__ import annotations

import asyncio
import logging

from pipeline.catalog.catalog import PoolModels
from pipeline.catalog.store import ModelStore
from pipeline.errors import LlmqError
from pipeline.models import now_ms
from pipeline.worker.backends.base import Backend, CatalogedBackend

log = logging.getLogger(__name__)

#: Short: a worker that stops waits for a publish still running in its thread.
_PUBLISH_TIMEOUT_S = 5.0


class Announcer:
    def __init__(self, settings, backend: Backend, pool: str, *, store: ModelStore | None = None):
        self.settings = settings
        self.backend = backend if isinstance(backend, CatalogedBackend) else None
        self.pool = pool
        self.store = store or ModelStore(settings)
        self.last: PoolModels | None = None

    async def read(self) -> PoolModels | None:
        """Ask the backend what its servers serve now (None: it cannot say)."""
        if self.backend is None:
            return None
        models, default, any_model = await self.backend.served_models()
        return PoolModels(self.pool, tuple(models), default, any_model, dict(self.settings.models.aliases), now_ms())

    async def announce(self) -> PoolModels | None:
        """One round: read, then publish (the list again, so that it does not expire)."""
        current = await self.read()
        if current is None:
            return None
        if not current.same_list(self.last):
            log.info("pool %s serves %s%s (default %s)", self.pool, ", ".join(current.models) or "no listed model",
                     " and any other name" if current.any_model else "", current.default or "unknown")
        try:
            await asyncio.to_thread(self.store.publish, current, _PUBLISH_TIMEOUT_S)
        except LlmqError as exc:
            log.warning("cannot publish the models of pool %s (%s); trying again in %.0f s", self.pool, exc,
                        self.settings.models.refresh_s)
        self.last = current
        return current

    async def run(self) -> None:
        """Announce every ``models.refresh_s`` until cancelled."""
        while True:
            try:
                await self.announce()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 (a failed round must not stop the worker)
                log.exception("reading or publishing the models of pool %s failed", self.pool)
            await asyncio.sleep(self.settings.models.refresh_s)
