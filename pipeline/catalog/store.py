"""The pools' model lists in the compacted topic ``<prefix>.models``, one record per pool.

Workers publish (:meth:`ModelStore.publish`, keyed by their pool's group id, so every worker of
a pool overwrites the same record); serve and the gateway follow the topic and ask
:meth:`ModelStore.catalog` for a snapshot. A record that does not parse is logged and skipped.
"""

from __future__ import annotations

import logging
from typing import Iterable

from pipeline.catalog.catalog import ModelCatalog, PoolModels
from pipeline.compacted import CompactedTopic
from pipeline.errors import ConfigError, KafkaOperationError

log = logging.getLogger(__name__)


class ModelStore:
    def __init__(self, settings):
        self.settings = settings
        self.topic = settings.models.topic(settings.topics.prefix)
        self._pools: dict[str, PoolModels] = {}
        self._catalog = ModelCatalog(settings.models)
        self._follower = CompactedTopic(settings, self.topic, apply=self.apply, name="model catalog",
                                        ensure=self.ensure, client_id="llmq-models")

    def catalog(self) -> ModelCatalog:
        return self._catalog

    def start(self, wait_s: float = 30.0) -> "ModelStore":
        self._follower.start(wait_s)
        return self

    @property
    def ready(self) -> bool:
        return self._follower.ready

    def stop(self) -> None:
        self._follower.stop()

    def apply(self, records: Iterable[tuple[bytes | None, bytes | None]]) -> None:
        pools = dict(self._pools)
        for key, value in records:
            if not key:
                continue
            name = key.decode(errors="replace")
            if value is None:
                pools.pop(name, None)
                continue
            try:
                pools[name] = PoolModels.from_json(value)
            except ConfigError as exc:
                log.warning("model catalog: the list of pool %r skipped: %s", name, exc.problem)
        self._pools = pools
        # One assignment: a reader sees one snapshot.
        self._catalog = ModelCatalog(self.settings.models, pools)

    def publish(self, pool: PoolModels, timeout: float = 15.0) -> None:
        self._follower.publish(pool.pool.encode(), pool.to_json(), timeout)

    def ensure(self) -> bool:
        """Create the topic if it is missing (``llmq topics create`` makes it too)."""
        from confluent_kafka.admin import AdminClient

        from pipeline.topics import ensure_topics, model_catalog_topic

        try:
            ensure_topics(AdminClient(self.settings.kafka.admin_config()), [model_catalog_topic(self.settings)],
                          timeout=15)
        except KafkaOperationError as exc:
            log.warning("cannot create the model catalog topic %s: %s", self.topic, exc)
            return False
        return True
