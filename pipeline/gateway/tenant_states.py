"""The tenants' state records (:class:`pipeline.policy.state.TenantState`) in a Faust table.

The table is keyed by the tenant id's bytes and uses the producer's partitioner
(``use_partitioner=True``): the request topics are keyed by tenant with the same murmur2 hash,
so a tenant's record lands in the changelog partition numbered like its request partition, and
Faust's assignor gives both (and the tenant's response partition: the three are co-partitioned)
to the same gateway. Records are read from the table once into memory, changed there by
admissions and completions, and written back at each flush, once per changed tenant: a tenant
that sends a hundred requests between flushes costs one changelog record, not a hundred. A
record that has nothing outstanding and full buckets is deleted instead (bounded state).

After a rebalance the memory is dropped, since another gateway may have changed the records
of partitions that were away; they are read from the (recovered) table again when needed.
"""

from __future__ import annotations

from pipeline.policy.state import TenantState


class TenantStates:
    def __init__(self, table):
        self.table = table
        self._live: dict[str, TenantState] = {}
        self._dirty: set[str] = set()

    def get(self, tenant: str) -> TenantState:
        state = self._live.get(tenant)
        if state is None:
            state = self._live[tenant] = TenantState.from_value(self.table.get(tenant.encode()))
        return state

    def changed(self, tenant: str) -> None:
        self._dirty.add(tenant)

    def flush(self, now_ms: float) -> int:
        """Write the changed records to the table; returns how many."""
        dirty, self._dirty = self._dirty, set()
        table, live = self.table, self._live
        for tenant in dirty:
            state = live.get(tenant)
            if state is None:
                continue
            key = tenant.encode()
            if state.idle(now_ms):
                del live[tenant]
                if key in table:
                    del table[key]
            else:
                table[key] = state.to_value()
        return len(dirty)

    def sweep(self, now_ms: float) -> None:
        """Mark every idle record in memory changed, so the next flush deletes it. Only records in
        memory: they were read for this gateway's own requests since the last rebalance, so their
        partitions are this gateway's (the table also holds standby partitions, which are not)."""
        self._dirty.update(t for t, state in self._live.items() if state.idle(now_ms))

    def forget(self) -> None:
        """Drop what memory holds (after a rebalance; flush first)."""
        self._live.clear()
        self._dirty.clear()

    def __len__(self) -> int:
        return len(self._live)
