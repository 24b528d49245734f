"""Prometheus metrics of llmq processes: one registry per process, served on --metrics-port.

Names follow Prometheus conventions (``llmq_`` prefix, base units, ``_total`` counters).
Labels are bounded: priorities and outcomes are fixed sets, reasons are the short codes
before the first ``:`` of a response reason, and tenants appear only through
:class:`TenantLabels` (an allow-list plus the top-N busiest, everything else ``other``).

The consumer-lag series use kafka_exporter's names, so existing dashboards (Grafana 7589)
and alert rules (Strimzi) work unchanged; see :mod:`pipeline.observability.lag`.
"""

from __future__ import annotations

import threading
from collections import Counter as _Counts

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import start_http_server

from pipeline.errors import ConfigError

# `x_created` series double every counter and histogram and no dashboard uses them.
disable_created_metrics()

OUTCOMES = ("admitted", "completed", "rejected", "expired", "failed", "cancelled", "degraded", "dead_lettered")

#: Queue waits of LLM requests span milliseconds (realtime) to many minutes (background).
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
#: Model calls: tens of milliseconds to minutes.
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


def reason_code(reason: str | None) -> str:
    """The bounded label for a free-text reason: its code before the first ':'."""
    if not reason:
        return "none"
    code = reason.split(":", 1)[0].strip().lower()
    return code[:40] if code.replace("_", "").isalnum() else "other"


class TenantLabels:
    """Maps tenant ids to a bounded label set: allow-listed ones, else the top-N seen, else 'other'."""

    def __init__(self, allow: tuple[str, ...] | list[str] = (), top_n: int = 10):
        self.allow = frozenset(allow)
        self.top_n = top_n
        self._counts: _Counts[str] = _Counts()
        self._top: frozenset[str] = frozenset()
        self._seen = 0
        self._lock = threading.Lock()

    def label(self, tenant: str) -> str:
        if tenant in self.allow:
            return tenant
        if self.top_n <= 0:
            return "other"
        with self._lock:
            self._counts[tenant] += 1
            self._seen += 1
            if self._seen % 1000 == 0 or len(self._top) < self.top_n:
                self._top = frozenset(t for t, _ in self._counts.most_common(self.top_n))
                if len(self._counts) > 100 * self.top_n:  # keep memory bounded under many tenants
                    self._counts = _Counts(dict(self._counts.most_common(10 * self.top_n)))
            return tenant if tenant in self._top else "other"


class WorkerMetrics:
    """What a worker process exports."""

    def __init__(self, pool: str = "all", registry: CollectorRegistry | None = None,
                 tenants: TenantLabels | None = None):
        self.registry = registry or CollectorRegistry()
        self.pool = pool
        self.tenants = tenants or TenantLabels()
        r = self.registry
        self.requests = Counter("llmq_requests", "Requests by priority and outcome.", ["priority", "outcome"],
                                registry=r)
        self.rejections = Counter("llmq_rejections", "Rejected requests by priority and reason.",
                                  ["priority", "reason"], registry=r)
        self.queue_wait = Histogram("llmq_queue_wait_seconds",
                                    "Time from a request's creation to the start of its processing.",
                                    ["priority"], buckets=WAIT_BUCKETS, registry=r)
        self.duration = Histogram("llmq_request_duration_seconds", "Time spent in the model backend.",
                                  ["priority", "model"], buckets=DURATION_BUCKETS, registry=r)
        self.tenant_wait = Histogram("llmq_tenant_queue_wait_seconds",
                                     "Queue wait per tenant (allow-listed and top-N tenants; the rest as 'other').",
                                     ["tenant"], buckets=WAIT_BUCKETS, registry=r)
        self.inflight = Gauge("llmq_inflight_requests", "Requests being processed now.", ["pool"], registry=r)
        self.tokens = Counter("llmq_tokens", "Tokens processed, by kind (prompt, completion).",
                              ["priority", "kind"], registry=r)
        self.last_commit = Gauge("llmq_last_commit_timestamp_seconds",
                                 "Unix time of the last successful offset commit.", ["pool"], registry=r)
        self.rebalances = Counter("llmq_rebalances", "Partition assignments and revocations.", ["pool"],
                                  registry=r)
        self.dead_letters = Counter("llmq_dead_letters", "Messages sent to the dead-letter topic, by reason.",
                                    ["reason"], registry=r)
        self.up = Gauge("llmq_worker_up", "1 while the worker's consume loop runs.", ["pool"], registry=r)
        # Bound children: label lookups are the expensive part of an observation.
        self._requests = {}
        self._waits = {}
        self.inflight_child = self.inflight.labels(pool)

    def outcome(self, priority: str, outcome: str) -> None:
        child = self._requests.get((priority, outcome))
        if child is None:
            child = self._requests[(priority, outcome)] = self.requests.labels(priority, outcome)
        child.inc()

    def waited(self, priority: str, tenant: str, seconds: float) -> None:
        child = self._waits.get(priority)
        if child is None:
            child = self._waits[priority] = self.queue_wait.labels(priority)
        child.observe(seconds)
        self.tenant_wait.labels(self.tenants.label(tenant)).observe(seconds)


def serve(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1"):
    """Serve ``registry`` on http://addr:port/metrics in a daemon thread; port 0 = don't."""
    if not port:
        return None
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise ConfigError("metrics_port", f"cannot serve metrics on {addr}:{port} ({exc.strerror}); "
                                          "pick another --metrics-port, or 0 to turn metrics off") from None
    return server
