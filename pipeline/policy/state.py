"""What the gateway remembers about one tenant between its requests. Pure, no I/O.

One record per tenant: its token buckets (:mod:`pipeline.policy.ratelimit`), its outstanding
requests per band (:mod:`pipeline.policy.fairness`), and ``applied``: per source (a request topic,
or the responses), the offset of the last record whose effect the state holds, so that a record
read again after a crash is applied once. The gateway keeps these records in a Faust table keyed
by tenant; ``to_value``/``from_value`` are the table's JSON form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.models import BANDS
from pipeline.policy import ratelimit


@dataclass
class TenantState:
    buckets: dict[str, list] = field(default_factory=dict)
    outstanding: list[int] = field(default_factory=lambda: [0] * len(BANDS))
    applied: dict[str, int] = field(default_factory=dict)
    #: The latest arrival time the buckets were charged at (epoch ms).
    clock: int = 0

    def bucket_time(self, arrived_ms: int) -> int:
        """The buckets' clock when a request that arrived at ``arrived_ms`` is read: its arrival,
        or the latest arrival they were charged at if that is later. A tenant's requests sit in
        five band topics and are not read in arrival order (CRITICAL first; after a failover, a
        band's backlog behind another band's fresh requests). A request is judged at its own
        arrival; a refusal's retry-after counts from this clock."""
        return arrived_ms if arrived_ms > self.clock else self.clock

    def charged_at(self, at_ms: int) -> None:
        if at_ms > self.clock:
            self.clock = at_ms

    def holds(self, source: str, offset: int) -> bool:
        """Whether the record at ``offset`` of ``source`` is applied already."""
        return offset <= self.applied.get(source, -1)

    def apply(self, source: str, offset: int) -> None:
        if offset > self.applied.get(source, -1):
            self.applied[source] = offset

    def admitted(self, rank: int) -> None:
        self.outstanding[rank] += 1

    def finished(self, rank: int) -> None:
        if self.outstanding[rank] > 0:
            self.outstanding[rank] -= 1

    def idle(self, now_ms: float) -> bool:
        """Nothing outstanding and every bucket full: forgetting the record changes nothing."""
        return not any(self.outstanding) and ratelimit.idle(self.buckets, now_ms)

    def to_value(self) -> dict:
        return {"b": self.buckets, "o": self.outstanding, "a": self.applied, "c": self.clock}

    @classmethod
    def from_value(cls, value) -> "TenantState":
        if not isinstance(value, dict):
            return cls()
        outstanding = [int(n) for n in value.get("o") or ()][: len(BANDS)]
        outstanding += [0] * (len(BANDS) - len(outstanding))
        buckets = {str(k): [float(v[0]), float(v[1])] for k, v in (value.get("b") or {}).items()
                   if isinstance(v, (list, tuple)) and len(v) == 2}
        applied = {str(k): int(v) for k, v in (value.get("a") or {}).items() if isinstance(v, int)}
        clock = value.get("c")
        return cls(buckets, outstanding, applied, int(clock) if isinstance(clock, (int, float)) else 0)
