"""Which partition a tenant's records live in, and which of them this gateway owns.

Everything the gateway keeps about a tenant is keyed by the tenant, hashed the way Java clients
and llmq's producers hash record keys (murmur2): its requests, responses and state records all
sit in the partition numbered ``murmur2(tenant) % partitions``, and Faust's assignor hands a
partition number of these co-partitioned topics to one gateway. Table keys that name their partition
outright (:func:`partition_key`: a NUL byte, the partition number, a unit separator) go to that
partition (:func:`partitioner`, Faust's ``producer_partitioner`` setting): records about a whole
partition's requests, such as the ids seen there.
"""

from __future__ import annotations

from pipeline.partitioning import tenant_partition

__all__ = ["Ownership", "key_partition", "partition_key", "partitioner", "tenant_partition"]

_US = b"\x1f"
_NUL = b"\x00"


def partition_key(partition: int, suffix: bytes) -> bytes:
    """A table key that :func:`partitioner` sends to ``partition`` (tenant ids have no NUL)."""
    return b"%s%d%s%s" % (_NUL, partition, _US, suffix)


def key_partition(key: bytes) -> int | None:
    """The partition a :func:`partition_key` names, else None."""
    if not key.startswith(_NUL):
        return None
    try:
        return int(key[1:key.index(_US)])
    except ValueError:
        return None


def partitioner(key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
    """Faust's producer partitioner: the partition a key names, else murmur2 of the key (the tenant)."""
    if key is None:
        return (available or all_partitions)[0]
    named = key_partition(key)
    if named is not None:
        return all_partitions[named % len(all_partitions)]
    return all_partitions[tenant_partition(key, len(all_partitions))]


class Ownership:
    """The request partitions assigned to this gateway now (standbys not included)."""

    def __init__(self, partitions: int):
        self.partitions = partitions
        self.active: frozenset[int] = frozenset()

    def assigned(self, request_partitions: set[int]) -> None:
        self.active = frozenset(request_partitions)

    def owns(self, partition: int) -> bool:
        return partition in self.active
