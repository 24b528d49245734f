"""A tenant's records all sit in the partition its requests hash to, and CRITICAL is served first."""

from __future__ import annotations

from faust.types import TP

from pipeline.gateway.app import BandFirst
from pipeline.gateway.partitions import Ownership, partitioner, tenant_partition


def test_table_keys_with_more_than_the_tenant_land_in_the_tenants_partition():
    parts = list(range(6))
    for tenant in (b"acme", b"tenant-42", "t\u00e9nant".encode()):
        home = tenant_partition(tenant, 6)
        assert partitioner(tenant, parts, parts) == home
        assert partitioner(tenant + b"\x1f1800000000000", parts, parts) == home


def test_ownership_follows_the_assigned_request_partitions():
    own = Ownership(6)
    own.assigned({tenant_partition(b"acme", 6)})
    assert own.owns(b"acme")
    own.assigned(set())
    assert not own.owns(b"acme")


def test_a_fetch_is_handed_over_higher_bands_first_each_bands_partitions_in_turn():
    strategy = BandFirst.for_topics({"r.critical": 0, "r.normal": 2, "r.background": 4})()
    records = {TP("r.background", 0): ["b0", "b1"], TP("r.normal", 1): ["n0"], TP("r.critical", 0): ["c0"],
               TP("r.critical", 1): ["c1", "c2"], TP("other", 0): ["o0"]}
    order = [record for _, record in strategy.iterate(records)]
    assert order == ["c0", "c1", "c2", "n0", "b0", "b1", "o0"]
