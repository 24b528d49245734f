"""The worker's /healthz and /readyz, served beside /metrics on worker.metrics_port.

Live: the consume loop turns (it polls every turn, paused partitions and long model calls
included, so a loop that has not turned for ``worker.stall_s`` is stuck in a call that never
returns), no fatal error ended the session, and the producer has its records acknowledged
(outstanding with no delivery for longer than librdkafka's delivery timeout plus a margin is
stuck). The coordinator watch (coordinator_watch.py) already replaces a consumer cut off from its
group, and a transaction that does not end in time already stops the worker (checkpoint.py).
Ready: live and a session consuming. Not "partitions assigned": a pool may run more workers than
its partitions (spares for failover, an autoscaler's), and a spare that never became ready would
hold up every rolling update.

Read from the metrics server's thread: only attribute reads of what the loop publishes.
"""

from __future__ import annotations

import time

from pipeline.observability.health import Health, Pending

#: librdkafka's message.timeout.ms default (5 min) plus a margin: past that a delivery report is overdue.
DELIVERY_TIMEOUT_S = 330.0


def worker_health(worker, clock=time.monotonic) -> Health:
    h = Health()
    stall_s = worker.cfg.stall_s
    pending = Pending(DELIVERY_TIMEOUT_S, "responses", clock=clock)

    def loop() -> str | None:
        turned = worker.turned_at
        if not stall_s or turned is None:
            return None
        idle = clock() - turned
        return f"the consume loop has not turned for {idle:.0f} s" if idle >= stall_s else None

    def session() -> str | None:
        return "the session stopped on a fatal error" if worker.session.fatal is not None else None

    def producer() -> str | None:
        p = worker.session.producer
        pending.observe(0 if p is None else len(p), worker.stats.delivered)
        return pending.reason()

    def running() -> str | None:
        if worker.turned_at is None or worker.session.consumer is None:
            return "not consuming yet"
        return None

    h.add_live("loop", loop)
    h.add_live("session", session)
    h.add_live("producer", producer)
    h.add_ready("consuming", running)
    return h
