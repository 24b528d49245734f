"""A worker group's session under the consumer group protocol (KIP-848).

Under that protocol the broker, not the consumer, owns the session timeout and the heartbeat
interval: librdkafka refuses ``session.timeout.ms`` and the group's own configs
(``consumer.session.timeout.ms``, ``consumer.heartbeat.interval.ms``) apply, within the
broker's ``group.consumer.min/max.*`` bounds. So that ``worker.session_timeout_ms`` means the
same under both protocols, each worker sets its group's configs at start. The call is
idempotent, and the workers of a pool ask for the same values.
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

from pipeline.config import Settings

log = logging.getLogger(__name__)

#: The broker's default (and minimum) heartbeat interval for consumer groups.
BROKER_DEFAULT_HEARTBEAT_MS = 5000


def group_session_configs(session_timeout_ms: int) -> dict[str, str | None]:
    """The group configs for a session of ``session_timeout_ms`` (None: back to the broker's
    default). The heartbeat interval is set only for a session shorter than three of the
    broker's default heartbeats (one late heartbeat must not end a session); otherwise the
    broker's own default applies, because heartbeats carry assignments: a longer one than the
    broker's makes every join and rebalance wait for it."""
    heartbeat = None
    if session_timeout_ms // 3 < BROKER_DEFAULT_HEARTBEAT_MS:
        heartbeat = str(max(1, session_timeout_ms // 3))
    return {"consumer.session.timeout.ms": str(session_timeout_ms), "consumer.heartbeat.interval.ms": heartbeat}


def apply_group_session(settings: Settings, group_id: str, timeout_s: float = 15.0) -> bool:
    """Set ``group_id``'s session configs; False (logged) when the broker refuses them, in
    which case its defaults apply (group.consumer.session.timeout.ms, 45 s unless changed)."""
    configs = group_session_configs(settings.worker.session_timeout_ms)
    resource = ConfigResource(ResourceType.GROUP, group_id, incremental_configs=[
        ConfigEntry(name, value, incremental_operation=AlterConfigOpType.DELETE) if value is None else
        ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET) for name, value in configs.items()])
    admin = AdminClient(settings.kafka.admin_config())
    try:
        for future in admin.incremental_alter_configs([resource], request_timeout=timeout_s).values():
            future.result(timeout_s)
    except (KafkaException, TimeoutError) as exc:
        log.warning("could not set group %s's session (%s): %s; the broker's defaults apply "
                    "(allow ALTER_CONFIGS on the group, or set the bounds group.consumer.min/max.*)",
                    group_id, _describe(configs), exc)
        return False
    log.info("group %s: %s", group_id, _describe(configs))
    return True


def _describe(configs: dict[str, str | None]) -> str:
    return ", ".join(f"{k}={'the broker default' if v is None else v}" for k, v in configs.items())
