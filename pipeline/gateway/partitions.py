"""Which partition a tenant's records live in, and which of them this gateway owns.

Everything the gateway keeps about a tenant is keyed by the tenant, hashed the way Java clients
and llmq's producers hash record keys (murmur2): its requests, responses and state records all
sit in the partition numbered ``murmur2(tenant) % partitions``, and Faust's assignor hands a
partition number of these co-partitioned topics to one gateway. Table keys that hold more than
the tenant (``tenant<US>...``) are hashed on the tenant part alone (:func:`partitioner`, Faust's
``producer_partitioner`` setting), so they land beside the tenant's other records.
"""

from __future__ import annotations

from aiokafka.partitioner import murmur2

_US = b"\x1f"


def tenant_partition(tenant_key: bytes, partitions: int) -> int:
    return (murmur2(tenant_key) & 0x7FFFFFFF) % partitions


def partitioner(key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
    """Faust's producer partitioner: murmur2 of the key up to its first unit separator."""
    if key is None:
        return (available or all_partitions)[0]
    cut = key.find(_US)
    return all_partitions[tenant_partition(key if cut < 0 else key[:cut], len(all_partitions))]


class Ownership:
    """The request partitions assigned to this gateway now (standbys not included)."""

    def __init__(self, partitions: int):
        self.partitions = partitions
        self.active: frozenset[int] = frozenset()

    def assigned(self, request_partitions: set[int]) -> None:
        self.active = frozenset(request_partitions)

    def owns(self, tenant_key: bytes) -> bool:
        return tenant_partition(tenant_key, self.partitions) in self.active
