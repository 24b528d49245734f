"""A gateway's group session: the failover it buys, within what the broker allows.

Every gateway is a classic-protocol group member (Faust's consumer is aiokafka's). A SIGKILLed
gateway sends no LeaveGroup, so its request partitions move only when its session expires: the
session timeout is most of a failover, and the rest (rebalance, the standby tables' catch-up, the
first admission) is short beside it: the standbys keep the tables nearly current. The broker
refuses a join whose session lies outside its ``group.min.session.timeout.ms`` …
``group.max.session.timeout.ms`` (6 s to 30 min unless changed), so the gateway asks for
``gateway.session_timeout_ms`` moved into those bounds, and says so when it had to move it.
Heartbeats go at a fifth of the session: one late heartbeat, or two, does not end it.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

log = logging.getLogger(__name__)


class SessionBounds(NamedTuple):
    """The sessions a broker allows a classic group member (``group.min/max.session.timeout.ms``)."""

    low_ms: int
    high_ms: int


#: Kafka's own bounds on a classic group's session, for a broker that does not say.
KAFKA_DEFAULT_BOUNDS_MS = SessionBounds(6_000, 1_800_000)


def session_within(asked_ms: int, bounds_ms: SessionBounds) -> int:
    """``asked_ms`` moved into the broker's bounds."""
    return min(max(asked_ms, bounds_ms.low_ms), bounds_ms.high_ms)


def heartbeat_ms(session_ms: int) -> int:
    return max(100, session_ms // 5)


def broker_session_bounds(admin: AdminClient, timeout_s: float = 10.0) -> SessionBounds | None:
    """The broker's bounds on a classic group's session; None when it cannot be asked (e.g. no
    DESCRIBE_CONFIGS on the cluster)."""
    try:
        brokers = admin.list_topics(timeout=timeout_s).brokers
        resource = ConfigResource(ResourceType.BROKER, str(min(brokers)))
        configs = admin.describe_configs([resource], request_timeout=timeout_s)[resource].result(timeout_s)
    except (KafkaException, TimeoutError, ValueError) as exc:
        log.info("could not read the broker's session bounds (%s); assuming Kafka's defaults", exc)
        return None

    def setting(name: str, default: int) -> int:
        entry = configs.get(name)
        return int(entry.value) if entry is not None and entry.value is not None else default

    return SessionBounds(setting("group.min.session.timeout.ms", KAFKA_DEFAULT_BOUNDS_MS.low_ms),
                         setting("group.max.session.timeout.ms", KAFKA_DEFAULT_BOUNDS_MS.high_ms))


def choose_session_ms(asked_ms: int, bounds_ms: SessionBounds | None) -> int:
    """The session the gateway joins with: ``asked_ms`` within the broker's bounds (Kafka's
    defaults when they are unknown), logged when it differs."""
    bounds = bounds_ms or KAFKA_DEFAULT_BOUNDS_MS
    chosen = session_within(asked_ms, bounds)
    if chosen != asked_ms:
        log.warning("gateway.session_timeout_ms is %d ms, but the broker allows %d to %d "
                    "(group.min/max.session.timeout.ms): joining with %d ms, so a killed gateway's "
                    "partitions move after about %.0f s", asked_ms, bounds.low_ms, bounds.high_ms, chosen,
                    chosen / 1000 + 1)
    return chosen
