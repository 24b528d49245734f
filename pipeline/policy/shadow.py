"""Shadow limits: a second admission policy that judges every request beside the real one. Pure.

An operator who wants to tighten a limit (a rate, a tenant's outstanding cap, a band's queue cap)
first wants to know whom it would refuse. :class:`Shadow` runs the same
:class:`~pipeline.policy.admission.Admission`, built from ``[gateway.shadow]``, on the same
requests at the same moment, and only reports its verdict; what the client gets is the real
policy's.

What the shadow sees:

* the real tenant's outstanding requests and the real queues (depths, drain, load), as they are
  before the real decision: those are facts about the pipeline, not about a policy;
* its own token buckets, charged when *it* would have admitted: a refused request costs nothing,
  as in the real buckets, so the count is of requests the shadow would refuse had the client
  sent the same traffic.

Its buckets live in this process only. After a gateway restarts or a tenant's partition moves,
they start full, so for a moment the shadow judges that tenant more leniently than it would.
The counts are a trial, not an accounting.
"""

from __future__ import annotations

from pipeline.models import Request
from pipeline.policy.admission import Admission, Decision
from pipeline.policy.state import TenantState


class Shadow:
    def __init__(self, admission: Admission):
        self.admission = admission
        #: tenant → the shadow's own buckets and clock (its outstanding counts stay zero).
        self._states: dict[str, TenantState] = {}

    def judge(self, req: Request, now_ms: int, real: TenantState, *, cancelled: bool = False,
              arrived_ms: int | None = None) -> Decision:
        """What the shadow policy would decide for ``req``, with ``real`` the tenant's state the
        real policy is about to decide on (read, never changed)."""
        own = self._states.get(req.tenant_id)
        if own is None:
            own = self._states[req.tenant_id] = TenantState()
        view = TenantState(own.buckets, list(real.outstanding), clock=own.clock)
        decision = self.admission.decide(req, now_ms, view, cancelled=cancelled, arrived_ms=arrived_ms)
        own.clock = view.clock
        return decision

    def sweep(self, now_ms: float) -> int:
        """Forget the tenants whose buckets are full again; returns how many are remembered."""
        for tenant in [t for t, s in self._states.items() if s.idle(now_ms)]:
            del self._states[tenant]
        return len(self._states)
