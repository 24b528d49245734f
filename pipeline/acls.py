"""Least-privilege ACLs, one principal per role.

| role        | may                                                                          |
|-------------|------------------------------------------------------------------------------|
| producer    | write the request topics                                                     |
| consumer    | read the response and chunk topics (the SDK assigns partitions: no group)    |
| client      | producer + consumer (an upstream service that submits and awaits)            |
| serve       | client + write cancellations + read the tenant registry and model catalog    |
|             | + the Batch API's files and batches topics and group, the stored responses   |
|             |   (``llmq serve``)                                                           |
| tenants     | read and write the tenant registry (``llmq tenants set``)                    |
| worker      | read request/dispatch/cancellation topics; write responses, chunks, receipts,|
|             | reply topics, dead letters, the model catalog; its groups (llmq-workers,     |
|             | llmq-pool-*; their session configs under the consumer group protocol); its   |
|             | transactional ids                                                            |
| gateway     | read requests/responses/receipts/cancellations/registry/catalog; write       |
|             | dispatch, responses, reply topics, dead letters; its group, changelogs, txns |
| lagexporter | describe topics and llmq-* groups (read nothing)                              |
| tenant.NAME | one tenant's own client: write requests, read only ``<prefix>.replies.NAME`` |

Topic ACLs use prefixed patterns on ``<prefix>.requests.`` / ``<prefix>.dispatch.`` /
``<prefix>.replies.`` so new bands and tenants need no new ACL for the pipeline's own roles.

Replies only to their owner: Kafka ACLs grant topics (literal or prefixed), never partitions, so a
principal that may read the response topic may read every partition of it, whichever reply
partition its requests name. Reply partitions keep a client from *receiving* others' answers
(and from paying to read them); they do not stop a principal from reading them on purpose. The
isolated option is a reply topic per tenant, ``<prefix>.replies.<tenant>``, named in the
requests' ``reply_to`` (``LlmqClient(reply_to=...)``): the ``tenant.NAME`` role reads only its own.
``tenant.NAME`` roles are listed for the tenants the settings name (``[tenants] records`` and
the registry file). A tenant whose requests are signed (``require_signature``) cannot be
impersonated by another principal allowed to write the request topics.
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


def reply_topic(settings: Settings, tenant: str) -> str:
    """The reply topic of one tenant, the one Kafka ACLs can isolate (see the module's doc)."""
    return f"{settings.topics.prefix}.replies.{tenant}"


def configured_tenants(settings: Settings) -> list[str]:
    """The tenants the settings name (inline records and the registry file; not the live topic)."""
    from pipeline.tenants.registry import TenantRegistry

    return sorted(TenantRegistry(settings).records())


def tenant_client_grants(settings: Settings, tenant: str) -> list[Grant]:
    """One tenant's own client: submit, cancel, and read only its reply topic."""
    t = settings.topics
    return [_topic(f"{t.prefix}.requests.", W, D, prefixed=True), _topic(f"{t.prefix}.cancellations", W, D),
            _topic(reply_topic(settings, tenant), R, D), _IDEMPOTENT]


def role_grants(settings: Settings, tenants: list[str] | None = None) -> dict[str, list[Grant]]:
    """Every role's grants; ``tenants`` (default: those the settings name) get a ``tenant.NAME`` role each."""
    t = settings.topics
    requests, dispatch = f"{t.prefix}.requests.", f"{t.prefix}.dispatch."
    replies = f"{t.prefix}.replies."
    cancellations = f"{t.prefix}.cancellations"
    registry = settings.tenants.topic(t.prefix)
    catalog = settings.models.topic(t.prefix)
    producer = [_topic(requests, W, D, prefixed=True), _IDEMPOTENT]
    consumer = [_topic(t.responses, R, D), _topic(t.chunks, R, D)]
    roles = {
        "producer": producer,
        "consumer": consumer,
        "client": producer + consumer,
        # the Batch API: its files and batches topics, and the group that shares the batches out
        "serve": producer + consumer + [_topic(cancellations, W, D), _topic(registry, R, D), _topic(catalog, R, D),
                                        _topic(t.files, R, W, D), _topic(t.batches, R, W, D),
                                        _topic(t.stored_responses, R, W, D),  # the Responses API
                                        _group(settings.batch.group(t.prefix), R)],
        "tenants": [_topic(registry, R, W, D), _IDEMPOTENT],
        "worker": [
            _topic(requests, R, D, prefixed=True), _topic(dispatch, R, D, prefixed=True),
            _topic(cancellations, R, D), _topic(t.responses, W, D), _topic(t.dlq, W, D),
            _topic(t.chunks, W, D), _topic(t.receipts, W, D), _topic(replies, W, D, prefixed=True),
            _topic(catalog, W, D),  # its servers' model list (pipeline/catalog/)
            # ALTER_CONFIGS: each worker sets its group's session (pipeline.worker.membership).
            _group(settings.worker.group_id, R, _GC), _group("llmq-pool-", R, _GC, prefixed=True),
            _txn("llmq-worker-"),
            _IDEMPOTENT,
        ],
        "gateway": [
            _topic(requests, R, D, prefixed=True), _topic(dispatch, W, D, prefixed=True),
            _topic(t.responses, R, W, D), _topic(t.receipts, R, D), _topic(t.dlq, W, D), _topic(cancellations, R, D),
            _topic(replies, W, D, prefixed=True), _topic(registry, R, D), _topic(catalog, R, D),
            # Faust's group and its internal topics (table changelogs, the assignor's topic)
            # are named after the app id.
            _group(settings.gateway.app_id, R, D, prefixed=True),
            _topic(settings.gateway.app_id, R, W, D, AclOperation.CREATE, AclOperation.DESCRIBE_CONFIGS,
                   prefixed=True),
            _txn(settings.gateway.app_id), _IDEMPOTENT,
        ],
        "lagexporter": [_topic(f"{t.prefix}.", D, prefixed=True), _group("llmq-", D, prefixed=True)],
    }
    for tenant in configured_tenants(settings) if tenants is None else tenants:
        roles[f"tenant.{tenant}"] = tenant_client_grants(settings, tenant)
    return roles


def bindings(settings: Settings, principals: dict[str, str] | None = None,
             tenants: list[str] | None = None) -> list[AclBinding]:
    """AclBindings for every role; ``principals`` maps role → principal (default User:<role>)."""
    out = []
    for role, grants in role_grants(settings, tenants).items():
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
