"""A tenant's records all sit in the partition its requests hash to, and CRITICAL is served first."""

from __future__ import annotations

from faust.types import TP

from pipeline.gateway.app import BandFirst
from pipeline.gateway.partitions import Ownership, key_partition, partition_key, partitioner, tenant_partition


def test_a_tenants_record_lands_in_its_partition_and_a_partitions_record_where_it_says():
    parts = list(range(6))
    for tenant in (b"acme", b"tenant-42", "t\u00e9nant".encode()):
        assert partitioner(tenant, parts, parts) == tenant_partition(tenant, 6)
    for p in parts:
        key = partition_key(p, b"1800000000000")
        assert partitioner(key, parts, parts) == p and key_partition(key) == p
    assert key_partition(b"acme") is None


def test_ownership_follows_the_assigned_request_partitions():
    own = Ownership(6)
    own.assigned({2, 4})
    assert own.owns(2) and not own.owns(3)
    own.assigned(set())
    assert not own.owns(2)


def test_a_fetch_is_handed_over_higher_bands_first_each_bands_partitions_in_turn():
    strategy = BandFirst.for_topics({"r.critical": 0, "r.normal": 2, "r.background": 4})()
    records = {TP("r.background", 0): ["b0", "b1"], TP("r.normal", 1): ["n0"], TP("r.critical", 0): ["c0"],
               TP("r.critical", 1): ["c1", "c2"], TP("other", 0): ["o0"]}
    order = [record for _, record in strategy.iterate(records)]
    assert order == ["c0", "c1", "c2", "n0", "b0", "b1", "o0"]
