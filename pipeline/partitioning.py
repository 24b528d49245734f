"""Which partition a tenant's records go to: ``murmur2(tenant) % partitions``.

Every producer in llmq (librdkafka's ``murmur2_random``, aiokafka in the gateway) and Java's
default partitioner hash a record key this way, so a tenant's requests, responses, receipts,
chunks and gateway state sit in the same partition number of every co-partitioned topic.
Code that must name that partition itself (a reply partition check, a chunk's partition)
asks here rather than hashing on its own.
"""

from __future__ import annotations

from functools import lru_cache

from aiokafka.partitioner import murmur2


#: A record sent to no partition in particular: the producer's partitioner picks its key's.
ANY_PARTITION = None


# Cached: murmur2 runs in Python, and the same few tenants ask again for every record.
@lru_cache(maxsize=65536)
def tenant_partition(tenant_key: bytes, partitions: int) -> int:
    return (murmur2(tenant_key) & 0x7FFFFFFF) % partitions
