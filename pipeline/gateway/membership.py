"""A gateway's group session: the failover it buys, within what the broker allows.

Every gateway is a classic-protocol group member (Faust's consumer is aiokafka's). A SIGKILLed
gateway sends no LeaveGroup, so its request partitions move only when its session expires: the
session timeout is most of a failover, and the rest (rebalance, the standby tables' catch-up, the
first admission) takes about a second. The broker refuses a join whose session lies outside its
``group.min.session.timeout.ms`` … ``group.max.session.timeout.ms`` (6 s to 30 min unless
changed), so the gateway asks for ``gateway.session_timeout_ms`` moved into those bounds, and says
so when it had to move it. Heartbeats go at a fifth of the session: one late heartbeat, or two,
does not end it.
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

log = logging.getLogger(__name__)

#: Kafka's own bounds on a classic group's session, for a broker that does not say.
KAFKA_DEFAULT_BOUNDS_MS = (6_000, 1_800_000)


def session_within(asked_ms: int, bounds_ms: tuple[int, int]) -> int:
    """``asked_ms`` moved into the broker's bounds."""
    low, high = bounds_ms
    return min(max(asked_ms, low), high)


def heartbeat_ms(session_ms: int) -> int:
    return max(100, session_ms // 5)


def broker_session_bounds(admin: AdminClient, timeout_s: float = 10.0) -> tuple[int, int] | None:
    """The broker's bounds on a classic group's session; None when it cannot be asked (e.g. no
    DESCRIBE_CONFIGS on the cluster)."""
    try:
        brokers = admin.list_topics(timeout=timeout_s).brokers
        resource = ConfigResource(ResourceType.BROKER, str(min(brokers)))
        configs = admin.describe_configs([resource], request_timeout=timeout_s)[resource].result(timeout_s)
    except (KafkaException, TimeoutError, ValueError) as exc:
        log.info("could not read the broker's session bounds (%s); assuming Kafka's defaults", exc)
        return None
    bounds = []
    for name, default in zip(("group.min.session.timeout.ms", "group.max.session.timeout.ms"),
                             KAFKA_DEFAULT_BOUNDS_MS):
        entry = configs.get(name)
        bounds.append(int(entry.value) if entry is not None and entry.value is not None else default)
    return bounds[0], bounds[1]


def choose_session_ms(asked_ms: int, bounds_ms: tuple[int, int] | None) -> int:
    """The session the gateway joins with: ``asked_ms`` within the broker's bounds (Kafka's
    defaults when they are unknown), logged when it differs."""
    chosen = session_within(asked_ms, bounds_ms or KAFKA_DEFAULT_BOUNDS_MS)
    if chosen != asked_ms:
        low, high = bounds_ms or KAFKA_DEFAULT_BOUNDS_MS
        log.warning("gateway.session_timeout_ms is %d ms, but the broker allows %d to %d "
                    "(group.min/max.session.timeout.ms): joining with %d ms, so a killed gateway's "
                    "partitions move after about %.0f s", asked_ms, low, high, chosen, chosen / 1000 + 1)
    return chosen
