"""Least-privilege ACLs, one principal per role.

| role        | may                                                                          |
|-------------|------------------------------------------------------------------------------|
| producer    | write the request topics                                                     |
| consumer    | read the response topic (the SDK assigns partitions: no group needed)        |
| client      | producer + consumer (an upstream service that submits and awaits)            |
| worker      | read request/dispatch/cancellation topics, write responses and dead letters, |
|             | its groups (llmq-workers, llmq-pool-*; their session configs under the       |
|             | consumer group protocol), its transactional ids (llmq-worker-*)              |
| gateway     | read requests/responses/cancellations, write dispatch/responses/dead letters,|
|             | its group, changelog topics and transactional ids (llmq-gateway*)            |
| lagexporter | describe topics and llmq-* groups (read nothing)                              |

Topic ACLs use prefixed patterns on ``<prefix>.requests.`` / ``<prefix>.dispatch.`` so new
bands need no new ACL; deploy/security/README.md shows the same for a production cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import KafkaException
from confluent_kafka.admin import (AclBinding, AclBindingFilter, AclOperation, AclPermissionType, AdminClient,
                                   ResourcePatternType, ResourceType)

from pipeline.config import Settings
from pipeline.errors import KafkaOperationError

R, W, D = AclOperation.READ, AclOperation.WRITE, AclOperation.DESCRIBE
_GC = AclOperation.ALTER_CONFIGS


@dataclass(frozen=True)
class Grant:
    resource: ResourceType
    name: str
    pattern: ResourcePatternType
    operations: tuple[AclOperation, ...]


def _topic(name: str, *ops, prefixed: bool = False) -> Grant:
    return Grant(ResourceType.TOPIC, name, ResourcePatternType.PREFIXED if prefixed else ResourcePatternType.LITERAL,
                 tuple(ops))


def _group(name: str, *ops, prefixed: bool = False) -> Grant:
    return Grant(ResourceType.GROUP, name, ResourcePatternType.PREFIXED if prefixed else ResourcePatternType.LITERAL,
                 tuple(ops))


#: Idempotent producers (all of llmq's) ask the cluster for a producer id.
_IDEMPOTENT = Grant(ResourceType.BROKER, "kafka-cluster", ResourcePatternType.LITERAL, (AclOperation.IDEMPOTENT_WRITE,))


def _txn(prefix: str) -> Grant:
    return Grant(ResourceType.TRANSACTIONAL_ID, prefix, ResourcePatternType.PREFIXED, (W, D))


def role_grants(settings: Settings) -> dict[str, list[Grant]]:
    t = settings.topics
    requests, dispatch = f"{t.prefix}.requests.", f"{t.prefix}.dispatch."
    cancellations = f"{t.prefix}.cancellations"
    producer = [_topic(requests, W, D, prefixed=True), _IDEMPOTENT]
    consumer = [_topic(t.responses, R, D)]
    return {
        "producer": producer,
        "consumer": consumer,
        "client": producer + consumer,
        "worker": [
            _topic(requests, R, D, prefixed=True), _topic(dispatch, R, D, prefixed=True),
            _topic(cancellations, R, D), _topic(t.responses, W, D), _topic(t.dlq, W, D),
            # ALTER_CONFIGS: each worker sets its group's session (pipeline.worker.membership).
            _group(settings.worker.group_id, R, _GC), _group("llmq-pool-", R, _GC, prefixed=True),
            _txn("llmq-worker-"),
            _IDEMPOTENT,
        ],
        "gateway": [
            _topic(requests, R, D, prefixed=True), _topic(dispatch, W, D, prefixed=True),
            _topic(t.responses, R, W, D), _topic(t.dlq, W, D), _topic(cancellations, R, D),
            # Faust's group and its internal topics (table changelogs, the assignor's topic)
            # are named after the app id.
            _group(settings.gateway.app_id, R, D, prefixed=True),
            _topic(settings.gateway.app_id, R, W, D, AclOperation.CREATE, AclOperation.DESCRIBE_CONFIGS,
                   prefixed=True),
            _txn(settings.gateway.app_id), _IDEMPOTENT,
        ],
        "lagexporter": [_topic(f"{t.prefix}.", D, prefixed=True), _group("llmq-", D, prefixed=True)],
    }


def bindings(settings: Settings, principals: dict[str, str] | None = None) -> list[AclBinding]:
    """AclBindings for every role; ``principals`` maps role → principal (default User:<role>)."""
    out = []
    for role, grants in role_grants(settings).items():
        principal = (principals or {}).get(role, f"User:{role}")
        for g in grants:
            for op in g.operations:
                out.append(AclBinding(g.resource, g.name, g.pattern, principal, "*", op, AclPermissionType.ALLOW))
    return out


def describe(settings: Settings) -> str:
    lines = [f"{'PRINCIPAL':<18} {'RESOURCE':<17} {'PATTERN':<9} {'NAME':<32} OPERATION"]
    for b in bindings(settings):
        lines.append(f"{b.principal:<18} {b.restype.name:<17} {b.resource_pattern_type.name:<9} {b.name:<32} "
                     f"{b.operation.name}")
    return "\n".join(lines)


def apply(admin: AdminClient, settings: Settings, wait_s: float = 15.0) -> int:
    """Create every binding (idempotent on the broker side) and wait until they are in force.

    Returns how many. Waiting matters: a client that starts before its ACLs propagate gets
    an authorization error, and for an idempotent producer that error is fatal.
    """
    wanted = bindings(settings)
    for binding, fut in admin.create_acls(wanted, request_timeout=30).items():
        try:
            fut.result()
        except KafkaException as exc:
            err = exc.args[0]
            raise KafkaOperationError(f"create ACL {binding.principal} {binding.operation.name} {binding.name}",
                                      err.str(), err) from exc
    deadline = time.monotonic() + wait_s
    any_acl = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, None, None, AclOperation.ANY,
                               AclPermissionType.ANY)
    while True:
        present = {(b.restype, b.name, b.resource_pattern_type, b.principal, b.operation)
                   for b in admin.describe_acls(any_acl, request_timeout=10).result()}
        missing = [b for b in wanted
                   if (b.restype, b.name, b.resource_pattern_type, b.principal, b.operation) not in present]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if missing:
        raise KafkaOperationError("apply ACLs", f"{len(missing)} bindings not visible after {wait_s:.0f}s")
    return len(wanted)
