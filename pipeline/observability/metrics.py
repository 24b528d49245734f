"""Prometheus metrics of llmq processes: one registry per process, served on --metrics-port.

Names follow Prometheus conventions (``llmq_`` prefix, base units, ``_total`` counters).
Labels are bounded: priorities and outcomes are fixed sets, reasons are the short codes
before the first ``:`` of a response reason, and tenants appear only through
:class:`TenantLabels` (an allow-list plus the top-N busiest, everything else ``other``).

The worker observes several metrics per message, so the series here are plain Python
numbers updated by the one thread that owns them, and exposed through a collector; the
stock prometheus_client metric objects take a lock and resolve labels on every call,
which cost more than decoding the message. Scrapes read the numbers without locking:
each value is a single int/float read, atomic in CPython.

The consumer-lag series use kafka_exporter's names, so existing dashboards (Grafana 7589)
and alert rules (Strimzi) work unchanged; see :mod:`pipeline.observability.lag`.
"""

from __future__ import annotations

import json
import math
import threading
from bisect import bisect_left
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from collections import Counter as _Counts

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import make_wsgi_app

from pipeline.errors import ConfigError
from pipeline.models import BANDS, Priority
from pipeline.observability.fair_share import FairShareWindow
from pipeline.observability.fairness import NOT_DEMAND, FairnessWindow

# `x_created` series double every counter and histogram and no dashboard uses them.
disable_created_metrics()

OUTCOMES = ("admitted", "completed", "rejected", "expired", "failed", "cancelled", "degraded", "dead_lettered")

#: Queue waits of LLM requests span milliseconds (realtime) to many minutes (background).
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
#: Model calls: tens of milliseconds to minutes.
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
#: Time to a stream's first token: what a chat user waits before text appears.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2.5, 5, 10, 30, 60, 300)
#: Gaps between a stream's tokens: milliseconds, longer under a full batch.
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


def reason_code(reason: str | None) -> str:
    """The bounded label for a free-text reason: its code before the first ':'."""
    if not reason:
        return "none"
    code = reason.split(":", 1)[0].strip().lower()
    return code[:40] if code.replace("_", "").isalnum() else "other"


class BoundedLabels:
    """Maps free values (tenant ids, model names) to a bounded label set: allow-listed ones,
    else the top-N seen, else 'other'.

    Used by one thread (the worker loop), so it takes no lock. It runs per message: values
    are counted in batches (``Counter.update`` of the last ``RANK_EVERY`` values), and the
    top-N is re-ranked after each batch.
    """

    RANK_EVERY = 1000

    def __init__(self, allow: tuple[str, ...] | list[str] = (), top_n: int = 10):
        self.allow = frozenset(allow)
        self.top_n = top_n
        self._counts: _Counts[str] = _Counts()
        self._top: frozenset[str] = frozenset()
        self._pending: list[str] = []

    def label(self, value: str) -> str:
        if value in self.allow:
            return value
        if self.top_n <= 0:
            return "other"
        pending = self._pending
        pending.append(value)
        top = self._top
        if len(pending) >= self.RANK_EVERY:
            top = self._rank()
        if value in top:
            return value
        if len(top) < self.top_n:
            self._top = top | {value}  # room left: no ranking needed yet
            return value
        return "other"

    def _rank(self) -> frozenset[str]:
        counts = self._counts
        if self._pending:
            counts.update(self._pending)
            self._pending.clear()
        top = self._top = frozenset(t for t, _ in counts.most_common(self.top_n))
        if len(counts) > 100 * self.top_n:  # bounded memory under very many tenants
            self._counts = _Counts(dict(counts.most_common(10 * self.top_n)))
        return top


TenantLabels = BoundedLabels


# -- lock-free series -------------------------------------------------------------------------


class _Child:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class _HistChild:
    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value


class _Series:
    kind = "counter"

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...] | list[str] = (), buckets=()):
        self.name, self.doc, self.labelnames = name, doc, tuple(labelnames)
        self.bucket_bounds = tuple(buckets)
        self.children: dict[tuple[str, ...], object] = {}

    def labels(self, *values: str):
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self.children[values] = (_HistChild(self.bucket_bounds) if self.kind == "histogram"
                                              else _Child())
        return child

    def family(self):
        items = list(self.children.items())
        if self.kind == "counter":
            fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
            for labels, child in items:
                fam.add_metric(list(labels), child.value)
        elif self.kind == "gauge":
            fam = GaugeMetricFamily(self.name, self.doc, labels=self.labelnames)
            for labels, child in items:
                fam.add_metric(list(labels), child.value)
        else:
            fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
            for labels, child in items:
                counts = list(child.counts)
                cumulative, running = [], 0
                for bound, n in zip((*self.bucket_bounds, math.inf), counts):
                    running += n
                    cumulative.append((_fmt_bound(bound), running))
                fam.add_metric(list(labels), cumulative, child.sum)
        return fam


class Counter(_Series):
    kind = "counter"


class Gauge(_Series):
    kind = "gauge"


class Histogram(_Series):
    kind = "histogram"


def _fmt_bound(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(float(bound))


class _Collector:
    def __init__(self, series: list[_Series]):
        self.series = series

    def collect(self):
        for s in self.series:
            yield s.family()


def health_series() -> tuple[Counter, Counter]:
    """``llmq_health_recoveries_total{cause}`` and ``llmq_health_stalls_total{cause}``: what every
    process with a progress watch (pipeline/observability/health.py) counts."""
    return (Counter("llmq_health_recoveries", "Stalls this process recovered from through a public API (a "
                                              "partition sought again, a new session), by cause.", ["cause"]),
            Counter("llmq_health_stalls", "Stalls this process did not recover from, by cause: it stopped being "
                                          "live and exited for its supervisor to restart it.", ["cause"]))


#: Prompt tokens a server had cached for one call: none, a block, a system prompt, a history.
CACHED_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)


class RoutingSeries:
    """How the OpenAI backend chose servers and what their prefix caches held (labels: the
    configured servers, a bounded set). One per process by default (:func:`routing_series`):
    the backend is made before the worker's metrics and records into these, which every
    :class:`WorkerMetrics` exports."""

    def __init__(self) -> None:
        self.routes = Counter("llmq_backend_routes", "Calls sent to each model server, by why it was chosen: prefix "
                                                     "(its cache holds the prompt's start), home (the prompt's "
                                                     "placement), spill (another was at its load bound or had no "
                                                     "slot), least_loaded (affinity off, or no server under the "
                                                     "bound).", ["server", "reason"])
        self.deferred = Counter("llmq_backend_route_deferrals", "Times a request waited for the busy server "
                                                                "holding its prefix instead of going elsewhere.",
                                ["server"])
        self.prompt_tokens = Counter("llmq_backend_prompt_tokens", "Prompt tokens of answered calls, per server.",
                                     ["server"])
        self.cached_prompt_tokens = Counter("llmq_backend_cached_prompt_tokens",
                                            "Prompt tokens the server reported found in its prefix cache "
                                            "(usage.prompt_tokens_details.cached_tokens), per server.", ["server"])
        self.cached_tokens = Histogram("llmq_backend_cached_tokens", "Cached prompt tokens per answered call, as "
                                                                     "the server reported them.", [],
                                       CACHED_TOKEN_BUCKETS)
        self.server_hit_ratio = Gauge("llmq_backend_prefix_cache_hit_ratio",
                                      "The server's own prefix-cache hit ratio (vllm:prefix_cache_hits over "
                                      "queries, tokens) over its last window of queries.", ["server"])
        self.kv_contradictions = Counter("llmq_backend_kv_contradictions",
                                         "Samples in which a server's KV-cache reading said full while it ran "
                                         "nothing and llmq had nothing in flight there (the reading is then not "
                                         "trusted).", ["server"])
        self.index_corrections = Counter("llmq_backend_prefix_index_corrections",
                                         "Times a server's answer reported fewer cached tokens than the routing "
                                         "index expected, and the index forgot that server's older entries.",
                                         ["server"])

    def series(self) -> list[_Series]:
        return [self.routes, self.deferred, self.prompt_tokens, self.cached_prompt_tokens, self.cached_tokens,
                self.server_hit_ratio, self.kv_contradictions, self.index_corrections]


_ROUTING: RoutingSeries | None = None


def routing_series() -> RoutingSeries:
    """This process's routing series (made at first use)."""
    global _ROUTING
    if _ROUTING is None:
        _ROUTING = RoutingSeries()
    return _ROUTING


class WorkerMetrics:
    """What a worker process exports."""

    def __init__(self, pool: str = "all", registry: CollectorRegistry | None = None,
                 tenants: TenantLabels | None = None):
        self.registry = registry or CollectorRegistry()
        self.pool = pool
        self.tenants = tenants or TenantLabels()
        # Model names come from request bodies: bounded like tenants, or a producer could
        # grow the series (and the scrape) without limit.
        self.models = BoundedLabels(top_n=20)
        self.requests = Counter("llmq_requests", "Requests by priority and outcome.", ["priority", "outcome"])
        self.rejections = Counter("llmq_rejections", "Rejected requests by priority and reason.",
                                  ["priority", "reason"])
        self.queue_wait = Histogram("llmq_queue_wait_seconds",
                                    "Time from a request's creation to the start of its processing.",
                                    ["priority"], WAIT_BUCKETS)
        self.duration = Histogram("llmq_request_duration_seconds", "Time spent in the model backend.",
                                  ["priority", "model"], DURATION_BUCKETS)
        self.tenant_wait = Histogram("llmq_tenant_queue_wait_seconds",
                                     "Queue wait per tenant (allow-listed and top-N tenants; the rest as 'other').",
                                     ["tenant"], WAIT_BUCKETS)
        self.inflight = Gauge("llmq_inflight_requests", "Requests being processed now.", ["pool"])
        self.tokens = Counter("llmq_tokens", "Tokens processed, by kind (prompt, completion).", ["priority", "kind"])
        self.last_commit = Gauge("llmq_last_commit_timestamp_seconds",
                                 "Unix time of the last successful offset commit.", ["pool"])
        self.rebalances = Counter("llmq_rebalances", "Partition assignments and revocations.", ["pool"])
        self.dead_letters = Counter("llmq_dead_letters", "Messages sent to the dead-letter topic, by reason.",
                                    ["reason"])
        self.up = Gauge("llmq_worker_up", "1 while the worker's consume loop runs.", ["pool"])
        self.preemptions = Counter(
            "llmq_preemptions", "Backend calls cancelled to free their slot for a waiting request of a higher "
                                "band, by the cancelled call's band (its request runs again later).", ["priority"])
        self.duplicates = Counter(
            "llmq_duplicate_requests", "Messages carrying a request id this worker had taken already, by what "
                                       "became of them: dropped (the first still in flight, its answer covers "
                                       "them) or repeated (given the first answer again).", ["action"])
        self.ttft = Histogram("llmq_time_to_first_token_seconds",
                              "Streamed requests: time from a request's creation to its first token published "
                              "as a chunk (its queue wait included).", ["priority"], TTFT_BUCKETS)
        self.inter_token = Histogram("llmq_inter_token_seconds",
                                     "Streamed requests: time between one chunk of text and the next.", ["priority"],
                                     TOKEN_GAP_BUCKETS)
        self.served_tokens = Counter(
            "llmq_tenant_served_tokens", "Tokens served per tenant and band, prompt + 2 x output (what fair "
                                         "queuing charges; allow-listed and top-N tenants, the rest as 'other').",
            ["priority", "tenant"])
        self.fair_share = Gauge(
            "llmq_tenant_fair_share_ratio", "Tokens served to a tenant with requests waiting over its weighted "
                                            "fair share of what the band served, last minute (1 = its share).",
            ["pool", "priority", "tenant"])
        self.fairness = Gauge("llmq_worker_fairness_jain_index",
                              "Jain's index of the waiting tenants' fair-share ratios in the band, last minute "
                              "(1 = each got its weighted share).", ["pool", "priority"])
        self.health_recoveries, self.health_stalls = health_series()
        routing = routing_series()
        self.backend_routes, self.backend_deferrals = routing.routes, routing.deferred
        self.backend_prompt_tokens = routing.prompt_tokens
        self.backend_cached_prompt_tokens = routing.cached_prompt_tokens
        self.backend_cached_tokens, self.backend_hit_ratio = routing.cached_tokens, routing.server_hit_ratio
        self.backend_kv_contradictions, self.backend_index_corrections = (routing.kv_contradictions,
                                                                          routing.index_corrections)
        self.registry.register(_Collector([
            self.requests, self.rejections, self.queue_wait, self.duration, self.tenant_wait, self.inflight,
            self.tokens, self.last_commit, self.rebalances, self.dead_letters, self.up, self.preemptions,
            self.duplicates, self.ttft, self.inter_token, self.served_tokens, self.fair_share, self.fairness,
            self.health_recoveries, self.health_stalls, *routing.series()]))
        self.share_windows = [FairShareWindow() for _ in BANDS]
        self.inflight_child = self.inflight.labels(pool)
        self.inflight_child.set(0)
        self._band_series: dict[str, tuple] = {}

    def served(self, tenant: str, rank: int, tokens: float) -> None:
        """A request of ``tenant`` in band ``rank`` was served ``tokens`` (fair queuing's cost)."""
        self.served_tokens.labels(BANDS[rank].value, self.tenants.label(tenant)).inc(tokens)
        self.share_windows[rank].served(tenant, tokens)

    def fairness_tick(self, waiting: list[dict]) -> None:
        """Once a second: ``waiting[rank]`` maps each tenant with requests waiting in that band to
        its weight. Updates the share ratios and Jain's index of the last minute."""
        label = self.tenants.label
        for rank, window in enumerate(self.share_windows):
            window.tick(waiting[rank])
            band = BANDS[rank].value
            ratios = window.ratios()
            for key in [k for k in self.fair_share.children if k[1] == band]:
                if key[2] not in ratios:
                    del self.fair_share.children[key]
            for tenant, ratio in ratios.items():
                name = label(tenant)
                if name != "other":
                    self.fair_share.labels(self.pool, band, name).set(round(ratio, 4))
            jain = window.jain()
            if jain is None:
                self.fairness.children.pop((self.pool, band), None)
            else:
                self.fairness.labels(self.pool, band).set(round(jain, 4))

    def first_token(self, priority: str, seconds: float) -> None:
        self.ttft.labels(priority).observe(seconds if seconds > 0 else 0.0)

    def next_token(self, priority: str, seconds: float) -> None:
        self.inter_token.labels(priority).observe(seconds if seconds > 0 else 0.0)

    def outcome(self, priority: str, outcome: str) -> None:
        self.requests.labels(priority, outcome).value += 1

    def waited(self, priority: str, tenant: str, seconds: float) -> None:
        band = self._band_series.get(priority)
        if band is None:
            band = self._band_series[priority] = self._series_of(priority)
        band[1].observe(seconds)
        self.tenant_wait.labels(self.tenants.label(tenant)).observe(seconds)

    def waited_many(self, taken: list, started_ms: int) -> None:
        """:meth:`waited` for the request of each of ``taken`` (anything with a ``request``: the
        worker's Taken), all started at ``started_ms``."""
        series, tenant_label = self._band_series, self.tenants.label
        tenant_children, tenant_wait = self.tenant_wait.children, self.tenant_wait.labels
        buckets = WAIT_BUCKETS
        for item in taken:
            request = item.request
            priority = request.priority._value_
            band = series.get(priority)
            if band is None:
                band = series[priority] = self._series_of(priority)
            seconds = started_ms - request.created_at
            seconds = seconds / 1000.0 if seconds > 0 else 0.0
            # _HistChild.observe, inline (both histograms have WAIT_BUCKETS)
            bucket = bisect_left(buckets, seconds)
            child = band[1]
            child.counts[bucket] += 1
            child.sum += seconds
            label = (tenant_label(request.tenant_id),)
            child = tenant_children.get(label) or tenant_wait(*label)
            child.counts[bucket] += 1
            child.sum += seconds

    def completed_many(self, done: list, seconds: float = 0.0) -> None:
        """Each of ``done`` (the worker's Answered: ``request``, ``completion``) COMPLETED, its backend
        call having taken ``seconds``: the outcome, backend time and tokens."""
        series, duration, model_label = self._band_series, self.duration, self.models.label
        for item in done:
            request, c = item.request, item.completion
            priority = request.priority._value_
            band = series.get(priority)
            if band is None:
                band = series[priority] = self._series_of(priority)
            done_child, _, prompt, completion = band
            done_child.value += 1
            prompt.value += c.prompt_tokens
            completion.value += c.completion_tokens
            duration.labels(priority, model_label(c.model)).observe(seconds)

    def _series_of(self, priority: str) -> tuple:
        # A band's children never change once created: looked up once, not per message.
        return (self.requests.labels(priority, "completed"), self.queue_wait.labels(priority),
                self.tokens.labels(priority, "prompt"), self.tokens.labels(priority, "completion"))


class GatewayMetrics:
    """What the gateway exports (same ``llmq_requests_total``/``llmq_rejections_total`` names as
    the workers, so one dashboard shows both; the gateway's outcomes are admitted, rejected,
    expired, cancelled, duplicate, redelivered, dead_lettered).

    Labels ``priority`` are the band a request asked for, except on the queue gauges, where
    they name the band (dispatch topic) itself. The queue gauges mirror ``GET /v1/queue``
    (:meth:`observe_queues`); ``llmq_gateway_fairness_jain`` is defined in
    :mod:`pipeline.observability.fairness` (:meth:`observe_fairness`, :meth:`refresh`).
    """

    #: Seconds of decisions behind the fairness index.
    FAIRNESS_WINDOW_S = 60.0

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.requests = Counter("llmq_requests", "Requests by priority and outcome.", ["priority", "outcome"])
        self.rejections = Counter("llmq_rejections", "Rejected requests by priority and reason.",
                                  ["priority", "reason"])
        self.dead_letters = Counter("llmq_dead_letters", "Messages sent to the dead-letter topic, by reason.",
                                    ["reason"])
        self.degraded = Counter("llmq_gateway_degraded", "Requests given the smaller model under load.",
                                ["priority"])
        self.reprioritised = Counter("llmq_gateway_reprioritised",
                                     "Admitted requests served in another band than requested.",
                                     ["requested", "effective"])
        self.finished = Counter("llmq_gateway_finished", "Terminal responses seen for dispatched requests.",
                                ["priority", "status"])
        self.depth = Gauge("llmq_gateway_queue_depth",
                           "Requests in the band's dispatch topic not yet committed by the workers, plus those this "
                           "gateway admitted since it last read the offsets.", ["priority"])
        self.cap = Gauge("llmq_gateway_queue_cap",
                         "Most requests a band may hold before queue_full (gateway.queue_caps; 0 = unbounded).",
                         ["priority"])
        self.eta = Gauge("llmq_gateway_eta_seconds",
                         "Estimated wait of a request admitted now, behind this band and the higher ones, at the "
                         "workers' measured capacity (+Inf: work waits and no capacity is known).", ["priority"])
        self.drain = Gauge("llmq_gateway_drain_rate", "Completions per second (smoothed over a few seconds).")
        self.capacity = Gauge("llmq_gateway_capacity",
                              "The workers' drain, in requests per second, while work waited for them: what ETAs "
                              "divide by; kept through idle spells (0: not measured yet).")
        self.arrival = Gauge("llmq_gateway_arrival_rate",
                             "Requests per second written to the dispatch topics (smoothed over a few seconds).")
        self.load = Gauge("llmq_gateway_load",
                          "How long work in the band waits, over gateway.target_queue_ms (1 = the target; at "
                          "most 10).", ["priority"])
        self.fairness = Gauge("llmq_gateway_fairness_jain",
                              "Jain's index of the tenants' admitted/requested shares in the band over the last "
                              "minute (1 = even-handed, 1/n = one of n tenants served).", ["priority"])
        self.fairness_tenants = Gauge("llmq_gateway_fairness_tenants",
                                      "Tenants behind llmq_gateway_fairness_jain (the index is at least 1/n).",
                                      ["priority"])
        self.shadow = Counter("llmq_gateway_shadow_decisions",
                              "What the shadow policy ([gateway.shadow]) would have decided, by decision (admitted, "
                              "rejected, expired, cancelled) and reason code; never enforced.", ["decision", "reason"])
        self.shadow_disagreements = Counter("llmq_gateway_shadow_disagreements",
                                            "Requests on which the shadow policy and the real one decide "
                                            "differently, by the real decision and the shadow's.", ["real", "shadow"])
        self.health_recoveries, self.health_stalls = health_series()
        self._fair: dict[str, FairnessWindow] = {}
        # Admissions and degradations exist at 0 per band from the start, so the first scrape is a
        # baseline and rate() sees the first requests, not only the ones after them.
        for band in Priority:
            self.requests.labels(band.value, "admitted")
            self.degraded.labels(band.value)
        self.registry.register(_Collector([
            self.requests, self.rejections, self.dead_letters, self.degraded, self.reprioritised, self.finished,
            self.depth, self.cap, self.eta, self.drain, self.capacity, self.arrival, self.load, self.fairness,
            self.fairness_tenants, self.shadow, self.shadow_disagreements, self.health_recoveries,
            self.health_stalls]))

    def outcome(self, priority: str, outcome: str, n: int = 1) -> None:
        self.requests.labels(priority, outcome).value += n

    def observe_queues(self, snapshot: dict) -> None:
        """The queue gauges from ``QueueModel.snapshot()`` (what ``GET /v1/queue`` shows)."""
        for band, b in snapshot["bands"].items():
            self.depth.labels(band).set(b["depth"])
            self.cap.labels(band).set(b["cap"])
            eta = b["eta_ms"]
            self.eta.labels(band).set(math.inf if eta is None else eta / 1000.0)
            self.load.labels(band).set(b["load"])
        self.drain.labels().set(snapshot["drain_rate_per_s"])
        self.capacity.labels().set(snapshot.get("capacity_per_s", 0.0))
        self.arrival.labels().set(snapshot["arrival_rate_per_s"])

    def observe_fairness(self, priority: str, tenant: str, admitted: bool, reason: str | None = None) -> None:
        """One admission decision on ``tenant``'s request of band ``priority``: admitted, or refused
        with ``reason`` (a refusal whose reason code is no demand, e.g. invalid_request, is ignored)."""
        if not admitted and reason is not None and reason_code(reason) in NOT_DEMAND:
            return
        window = self._fair.get(priority)
        if window is None:
            window = self._fair[priority] = FairnessWindow(self.FAIRNESS_WINDOW_S)
        window.observe(tenant, admitted)

    def refresh(self, now_s: float) -> None:
        """Move the fairness windows to ``now_s`` (monotonic seconds) and set their gauges; a band
        without demand in the window has no index (its series disappear)."""
        for band, window in self._fair.items():
            window.advance(now_s)
            index = window.index()
            if index is None:
                self.fairness.children.pop((band,), None)
                self.fairness_tenants.children.pop((band,), None)
            else:
                self.fairness.labels(band).set(index)
                self.fairness_tenants.labels(band).set(window.tenants)


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name): scrapes are not log lines
        pass


def health_app(registry: CollectorRegistry, health=None):
    """A WSGI app: ``/healthz`` and ``/readyz`` from ``health`` (a
    :class:`~pipeline.observability.health.Health`), everything else prometheus_client's exposition
    of ``registry`` (as its own server serves it)."""
    metrics_app = make_wsgi_app(registry)
    kinds = {"/healthz": "live", "/readyz": "ready"}

    def app(environ, start_response):
        kind = kinds.get(environ.get("PATH_INFO", ""))
        if kind is None or health is None:
            return metrics_app(environ, start_response)
        code, doc = health.answer(kind)
        body = json.dumps(doc, separators=(",", ":")).encode()
        start_response("200 OK" if code == 200 else f"{code} Service Unavailable",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return app


def serve(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1", health=None):
    """Serve ``registry`` on http://addr:port/metrics, and ``health`` on /healthz and /readyz, in a
    daemon thread; port 0 = don't."""
    if not port:
        return None
    try:
        server = make_server(addr, port, health_app(registry, health), _ThreadingServer, handler_class=_QuietHandler)
    except OSError as exc:
        raise ConfigError("metrics_port", f"cannot serve metrics on {addr}:{port} ({exc.strerror}); "
                                          "pick another --metrics-port, or 0 to turn metrics off") from None
    threading.Thread(target=server.serve_forever, name="llmq-metrics-http", daemon=True).start()
    return server
