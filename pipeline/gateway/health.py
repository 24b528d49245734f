"""The gateway's /healthz and /readyz (Faust web views), and its exit when it has stalled.

Live: its request and response partitions make progress (:mod:`pipeline.gateway.stall_watch`),
its outputs are acknowledged (at-least-once: librdkafka's producer, whose message timeout stops
the gateway anyway) and its transactions end in time (exactly-once), and no output was refused.
Ready: live, started (the tables recovered, :class:`_GatewayWorker` in app.py says so), not
rebalancing or recovering now, and its consumer made. Not "partitions assigned": a spare gateway
(more gateways than partitions) is ready, or it would hold up a StatefulSet's rolling update.

A stall the watch could not recover from stops the gateway through Faust (``app.crash``: the
process exits non-zero, its supervisor starts another). A shutdown that itself hangs on what has
stalled is cut short after ``EXIT_GRACE_S``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from pipeline.errors import LlmqError
from pipeline.observability.health import Health, Pending

log = logging.getLogger(__name__)

#: How long an orderly stop after a stall may take before the process exits regardless.
EXIT_GRACE_S = 10.0
#: Exit status of a stalled gateway whose orderly stop hung (EX_SOFTWARE).
EXIT_STALLED = 70
#: Outputs (librdkafka, message.timeout.ms of a minute) outstanding with none acknowledged for this long.
OUTPUTS_TIMEOUT_S = 90.0


class GatewayHealth:
    def __init__(self, gateway):
        self.gateway = gateway
        self.started = False
        self.health = h = Health()
        watch = gateway.stall_watch
        if watch is not None:
            h.add_live("progress", watch.reason)
        self._outputs = Pending(OUTPUTS_TIMEOUT_S, "gateway outputs")
        if gateway.outputs is not None:
            h.add_live("outputs", self._outputs.reason)
        if gateway.transactions is not None:
            h.add_live("transactions", self._transactions)
        h.add_live("refused", self._refused)
        h.add_ready("started", lambda: None if self.started else "starting (tables not recovered yet)")
        h.add_ready("recovery", self._recovery)
        h.add_ready("consumer", self._consumer)

    def tick(self) -> None:
        """Once a second (a timer): what the producer has outstanding."""
        outputs = self.gateway.outputs
        if outputs is not None:
            self._outputs.observe(len(outputs.producer), outputs.delivered_total)

    def _transactions(self) -> str | None:
        txns = self.gateway.transactions
        return Pending.oldest(list(txns.open_since.values()), txns.transaction_timeout_ms / 1000.0,
                              "a transaction", time.monotonic())

    def _refused(self) -> str | None:
        g = self.gateway
        failed = (g.outputs.failed if g.outputs is not None else []) + (
            g.transactions.failed if g.transactions is not None else [])
        return "an output was refused; stopping" if failed else None

    def _recovery(self) -> str | None:
        app = self.gateway.app
        if app.tables.recovery.in_recovery:
            return "recovering tables"
        if app.rebalancing:
            return "rebalancing"
        return None

    def _consumer(self) -> str | None:
        try:
            self.gateway.app.consumer.assignment()
        except Exception:  # noqa: BLE001 (no consumer yet)
            return "no consumer yet"
        return None

    # -- the web views ------------------------------------------------------------------

    async def healthz(self, view, request):
        code, doc = self.health.answer("live")
        return view.json(doc, status=code)

    async def readyz(self, view, request):
        code, doc = self.health.answer("ready")
        return view.json(doc, status=code)

    # -- giving up ----------------------------------------------------------------------

    def give_up(self, detail: str) -> None:
        """Stop the gateway, non-zero (the cause is logged and counted by the watch already)."""
        app = self.gateway.app
        self.gateway._stopping = True

        def hard_exit() -> None:
            time.sleep(EXIT_GRACE_S)
            log.error("the stalled gateway did not stop within %.0f s; exiting now", EXIT_GRACE_S)
            logging.shutdown()
            os._exit(EXIT_STALLED)

        threading.Thread(target=hard_exit, name="llmq-gateway-exit", daemon=True).start()
        asyncio.ensure_future(app.crash(LlmqError(f"gateway not live: {detail}")))
