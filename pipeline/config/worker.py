"""[worker]: the inference workers (``llmq worker``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.config.fields import is_http_url, non_negative, parse_routes, positive, read_secret_file
from pipeline.config.topics import DEFAULT_POOLS
from pipeline.errors import ConfigError
from pipeline.models import Priority


@dataclass
class WorkerSettings:
    group_id: str = "llmq-workers"
    #: Pool: realtime, async, background or all; picks the bands consumed. A pool other
    #: than "all" uses group "llmq-pool-<pool>" unless group_id is set explicitly.
    pool: str = "all"
    #: Prometheus metrics on metrics_addr:<port>/metrics; 0 = off.
    metrics_port: int = 9101
    metrics_addr: str = "127.0.0.1"
    #: Worker identity written into responses; empty = "<hostname>-<pid>".
    worker_id: str = ""
    #: Requests in flight to the backend at once, per worker process.
    max_inflight: int = 64
    #: Messages taken from the consumer per poll.
    batch_size: int = 500
    #: How often finished offsets are committed (they are also committed on revoke/shutdown).
    commit_interval_ms: int = 500
    #: The longest an idle worker waits before it looks again (commits, cancellations, the
    #: backlog). With no backend call in flight it waits in the consumer's poll, which returns
    #: as soon as a message arrives; with calls in flight it sleeps this long between polls,
    #: so a new request waits up to this long to start (2 ms: a few hundred non-blocking
    #: polls a second, next to a time to first token measured in tens of ms).
    idle_poll_ms: int = 2
    #: How long responses wait to be sent together (linger.ms of the worker's producer; a
    #: linger.ms in [kafka.properties] still wins). Lower shortens a response's way, at the
    #: cost of a produce request per response or two when they are sparse.
    producer_linger_ms: int = 5
    #: On SIGTERM, how long in-flight requests may still finish before they are handed back.
    shutdown_grace_s: float = 10.0
    #: "simulated" or "openai" (any OpenAI-compatible chat-completions server).
    backend: str = "simulated"
    sim_latency_ms: float = 0.0
    sim_ms_per_token: float = 0.0
    openai_base_url: str = "http://127.0.0.1:8000/v1"
    openai_api_key: str = field(default="", repr=False)
    openai_api_key_file: str = ""
    #: Per model call (never past the request's own deadline), and tries before FAILED.
    backend_timeout_s: float = 60.0
    backend_max_attempts: int = 3
    #: Which servers answer which model: "MODEL=URL[,URL];MODEL2=URL;*=URL" ("*" takes every
    #: other model). Empty: every model goes to openai_base_url. A request for a model with no
    #: route is answered FAILED (model_unavailable) without a call; a model's calls are spread
    #: over its servers (fewest in flight) and fail over between them.
    openai_routes: str = ""
    #: Send each server only what it can start now (from its vLLM-style /metrics while they are
    #: fresh, else an AIMD limit on time to first token), and keep the rest waiting in llmq's
    #: priority queues rather than in the server's first-come-first-served one. false: up to
    #: max_inflight calls, whatever the server holds.
    backend_pacing: bool = True
    #: A server's in-flight limit before its metrics or first tokens have said anything.
    backend_initial_inflight: int = 4
    #: How often each server's /metrics is read while pacing.
    backend_metrics_interval_ms: int = 50
    #: A metrics sample older than this is not trusted (the TTFT limit takes over): more than
    #: backend_metrics_interval_ms, or every sample would be stale before the next one.
    backend_metrics_stale_ms: int = 200
    #: Call servers with stream: true (the time to first token paces them, and a cancelled call
    #: closes its connection, which stops the generation). Requests with stream set are always
    #: streamed, whatever this says.
    backend_stream: bool = True
    #: A server whose streams carry no usage (llama-cpp-python) is asked for whole answers for
    #: requests that are not streamed, so that their token counts are the server's own rather
    #: than llmq's estimate.
    backend_prefer_real_usage: bool = True
    #: Route by prefix cache (docs/workers.md, "Routing by cache"): a call goes to the server of
    #: its model most likely to hold its prompt's start (the placement every worker computes
    #: alike from the conversation or prompt_cache_key, and this worker's index of what each
    #: server was sent), within a load bound. false: a free slot and the fewest calls in flight.
    backend_prefix_affinity: bool = True
    #: The load bound: no server above (1 + epsilon) of its fair share of the calls...
    backend_affinity_epsilon: float = 0.25
    #: ...except that a server may always hold this many (the bound at low load).
    backend_affinity_bound_floor: int = 4
    #: How long a request whose prefix a busy server holds may wait for a slot there before it
    #: goes to another server and recomputes its prefix (one-off prompts never wait).
    backend_affinity_wait_ms: int = 250
    #: Characters per hashed prompt block of the index (about 64 tokens).
    backend_affinity_block_chars: int = 256
    #: Blocks the index remembers per server (least recently sent forgotten first), and how
    #: long an entry counts (servers evict; their answers' cached_tokens correct it too).
    backend_affinity_index_blocks: int = 65536
    backend_affinity_ttl_s: float = 120.0
    #: librdkafka max.poll.interval.ms for workers; the loop never blocks on the backend.
    max_poll_interval_ms: int = 300_000
    #: How long a silent (crashed, frozen) worker keeps its partitions before the group moves them.
    #: Classic protocol: the consumer's session.timeout.ms. Consumer protocol: the group's
    #: consumer.session.timeout.ms, set by each worker at start (the broker bounds it with
    #: group.consumer.min/max.session.timeout.ms; if it refuses, its default applies, logged).
    session_timeout_ms: int = 45_000
    #: A consumer whose group coordinator (its connection, or the group's state in librdkafka's
    #: statistics) has not been up for this long is replaced: a new session, new clients, from
    #: the committed offsets (pipeline/worker/coordinator_watch.py). 0 = never.
    coordinator_stall_ms: int = 30_000
    #: Liveness (GET /healthz on metrics_port): a consume loop that has not turned for this long
    #: is stuck (it turns while partitions are paused for backpressure and while model calls run),
    #: and the probe's supervisor restarts the process (pipeline/worker/health.py). 0 = no watch.
    stall_s: float = 60.0
    #: Consumer group protocol. "consumer" (KIP-848, brokers >= Kafka 4.0): the broker assigns
    #: partitions, incrementally, with group_remote_assignor. "classic" (older brokers):
    #: cooperative-sticky, which balances only the number of partitions per worker, so a worker
    #: that joins a running pool can be given whole bands while another keeps the busy one.
    group_protocol: str = "consumer"
    #: Broker-side assignor under the consumer protocol: "range" gives every worker of a pool a
    #: share of every band's partitions; "uniform" (the broker's default) balances only counts.
    group_remote_assignor: str = "range"
    #: Static membership (group.instance.id = the worker id): a worker restarted within the
    #: session timeout gets its partitions back and nobody else's move (rolling restarts); one
    #: that stops for good keeps its partitions until the session times out. Needs a worker_id
    #: that survives restarts (a pod name), not the default <hostname>-<pid>.
    static_membership: bool = False
    #: "at-least-once" (commit after the broker acknowledged each response) or "exactly-once"
    #: (responses and offsets in one transaction per commit interval; read responses with
    #: isolation.level=read_committed).
    delivery: str = "at-least-once"
    transaction_timeout_ms: int = 60_000
    #: Minimum share of a worker's dispatches each lower band keeps while higher bands are busy
    #: (anti-starvation); the rest goes strictly by priority.
    band_min_share: dict[str, float] = field(default_factory=lambda: {
        "HIGH": 0.10, "NORMAL": 0.05, "LOW": 0.05, "BACKGROUND": 0.05})
    #: Preemption: a request waiting in a higher band while every backend slot is busy may
    #: cancel a running call of one of these bands; the cancelled request goes back to the
    #: head of its queue and runs again later (nothing is answered or committed for it
    #: meanwhile). The most recently started call of the lowest band goes first, and only
    #: when the band scheduler would serve the waiting band next (minimum shares hold).
    #: [] = never preempt. The partial call is wasted work: llmq_preemptions_total counts it.
    preempt_bands: list[str] = field(default_factory=lambda: ["LOW", "BACKGROUND"])
    #: Times one request may be preempted; after that its call runs to the end (bounds the waste).
    max_preemptions: int = 2
    #: A waiting request preempts only after it has waited this long for a slot to free on its
    #: own (fair preemption too). 0: at once, the lowest latency for the higher band. Where calls
    #: are short and slots many, one frees every few milliseconds, and a little patience saves
    #: the preempted calls' work for the lower band at that much latency to the higher.
    preempt_after_ms: int = 0
    #: Fairness between tenants inside a band: while every slot is busy, a request whose tenant
    #: (the message key: the gateway and the llmq client key by tenant) runs no call in its band
    #: takes the slot of the most recently started call of a tenant running two or more in that
    #: band, which goes back to its queue behind it (max_preemptions bounds it too). Without it a
    #: flooding tenant holding every slot makes a quiet one wait for one of its calls to end.
    fair_preemption: bool = True
    #: How far a worker reads ahead of its free slots, so that fair queuing chooses among
    #: everyone who waits and not only among what was read first: up to this many requests per
    #: partition, and this many bytes of requests in all (each counted at its record's size plus
    #: a fixed overhead for its decoded form). A partition past either is paused until it drains
    #: to half. What is read ahead is not committed until done: a crash redelivers it.
    lookahead_requests: int = 4096
    lookahead_bytes: int = 64 * 1024 * 1024
    #: Weighted fair queuing between tenants inside a band (docs/workers.md). false: one queue
    #: per band in deadline order (first come, first served for equal timeouts), whatever the tenant.
    fair_queuing: bool = True
    #: Each tenant's share of a band against the others (weighted fair queuing by tokens);
    #: these win over the tenant registry's ``weight``; a tenant in neither has weight 1.
    tenant_weights: dict[str, float] = field(default_factory=dict)
    #: Recent request ids a worker remembers, to answer a re-submitted id only once (0 = off).
    dedupe_window: int = 100_000
    #: A copy the gateway dispatched again, reaching a worker that did not take the first: the
    #: most records of its reply partition read back for the first answer (0 = never look; the
    #: copy then runs again, and its answer may differ from the first).
    look_back_max_records: int = 200_000
    #: Tenants that get their own metric label: these, plus the N busiest; the rest are "other".
    metrics_tenants: list[str] = field(default_factory=list)
    metrics_tenant_top_n: int = 10
    #: "requests": consume the request topics directly (gateway-less, small set-ups);
    #: "dispatch": consume what the gateway admitted (llm.dispatch.<band>).
    source: str = "requests"


    def group_ids(self) -> list[str]:
        """Every consumer group a worker of these settings may join, whatever its pool."""
        if self.group_id != WorkerSettings.group_id:
            return [self.group_id]
        return [self.group_id, *(f"llmq-pool-{pool}" for pool in DEFAULT_POOLS if pool != "all")]

    def api_key(self) -> str:
        """The model servers' API key: from ``openai_api_key_file`` when set, else ``openai_api_key``."""
        if self.openai_api_key_file:
            return read_secret_file("worker.openai_api_key_file", self.openai_api_key_file)
        return self.openai_api_key

    def effective_group_id(self) -> str:
        if self.pool != "all" and self.group_id == WorkerSettings.group_id:
            return f"llmq-pool-{self.pool}"
        return self.group_id

    def membership_config(self, worker_id: str) -> dict[str, Any]:
        """The consumer properties of the group protocol and membership; None removes a
        property, as librdkafka refuses the classic protocol's under the consumer protocol."""
        if self.group_protocol == "classic":
            conf: dict[str, Any] = {"session.timeout.ms": self.session_timeout_ms}
        else:
            conf = {"group.protocol": "consumer", "group.remote.assignor": self.group_remote_assignor,
                    "partition.assignment.strategy": None}
        if self.static_membership:
            conf["group.instance.id"] = worker_id
        return conf

    def validate(self) -> None:
        for key in ("max_inflight", "batch_size", "commit_interval_ms", "idle_poll_ms", "max_poll_interval_ms",
                    "session_timeout_ms", "lookahead_requests", "lookahead_bytes"):
            positive(f"worker.{key}", getattr(self, key))
        weights = {}
        for tenant, weight in self.tenant_weights.items():
            try:
                weights[tenant] = float(weight)
            except (TypeError, ValueError):
                raise ConfigError(f"worker.tenant_weights.{tenant}", f"must be a number, got {weight!r}") from None
            if not weights[tenant] > 0:
                raise ConfigError(f"worker.tenant_weights.{tenant}", f"must be more than 0, got {weight!r}")
        self.tenant_weights = weights
        for key in ("shutdown_grace_s", "sim_latency_ms", "sim_ms_per_token", "metrics_tenant_top_n", "dedupe_window",
                    "coordinator_stall_ms", "look_back_max_records"):
            non_negative(f"worker.{key}", getattr(self, key))
        non_negative("worker.producer_linger_ms", self.producer_linger_ms)
        non_negative("worker.stall_s", self.stall_s)
        shares = {}
        for band, share in self.band_min_share.items():
            if band not in Priority.__members__:
                raise ConfigError(f"worker.band_min_share.{band}", f"unknown band (known: {', '.join(Priority.__members__)})")
            try:
                shares[band] = float(share)
            except (TypeError, ValueError):
                raise ConfigError(f"worker.band_min_share.{band}", f"must be a number, got {share!r}") from None
            if not 0 <= shares[band] < 1:
                raise ConfigError(f"worker.band_min_share.{band}", f"must be in [0, 1), got {share!r}")
        if sum(shares.values()) >= 1:
            raise ConfigError("worker.band_min_share", "the minimum shares must add up to less than 1")
        self.band_min_share = shares
        for band in self.preempt_bands:
            if band not in Priority.__members__:
                raise ConfigError("worker.preempt_bands", f"unknown band {band!r} (known: {', '.join(Priority.__members__)})")
        if Priority.CRITICAL.value in self.preempt_bands:
            raise ConfigError("worker.preempt_bands", "CRITICAL has no higher band to give way to")
        non_negative("worker.max_preemptions", self.max_preemptions)
        non_negative("worker.preempt_after_ms", self.preempt_after_ms)
        if self.group_protocol not in ("consumer", "classic"):
            raise ConfigError("worker.group_protocol", "must be 'consumer' (KIP-848, Kafka >= 4.0) or 'classic'")
        if not self.group_remote_assignor:
            raise ConfigError("worker.group_remote_assignor", "must name a broker-side assignor, e.g. 'range'")
        if self.delivery not in ("at-least-once", "exactly-once"):
            raise ConfigError("worker.delivery", "must be 'at-least-once' or 'exactly-once'")
        positive("worker.transaction_timeout_ms", self.transaction_timeout_ms)
        if self.pool not in DEFAULT_POOLS:
            raise ConfigError("worker.pool", f"unknown pool {self.pool!r} (known: {', '.join(DEFAULT_POOLS)})")
        if self.backend not in ("simulated", "openai"):
            raise ConfigError("worker.backend", f"unknown backend {self.backend!r} (known: simulated, openai)")
        if self.backend == "openai" and not is_http_url(self.openai_base_url):
            raise ConfigError("worker.openai_base_url", "must be an http:// or https:// URL")
        positive("worker.backend_timeout_s", self.backend_timeout_s)
        positive("worker.backend_max_attempts", self.backend_max_attempts)
        self._validate_backend()
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError("worker.metrics_port", f"must be a TCP port or 0 (off), got {self.metrics_port}")
        if self.source not in ("requests", "dispatch"):
            raise ConfigError("worker.source", "must be 'requests' (gateway-less) or 'dispatch' (behind the gateway)")

    def _validate_backend(self) -> None:
        if self.openai_routes.strip():
            try:
                parse_routes(self.openai_routes)
            except ValueError as exc:
                raise ConfigError("worker.openai_routes", f"{exc} (expected MODEL=URL[,URL];*=URL)") from None
        for key in ("backend_initial_inflight", "backend_metrics_interval_ms", "backend_metrics_stale_ms"):
            positive(f"worker.{key}", getattr(self, key))
        for key in ("backend_affinity_epsilon", "backend_affinity_bound_floor", "backend_affinity_block_chars",
                    "backend_affinity_index_blocks", "backend_affinity_ttl_s"):
            positive(f"worker.{key}", getattr(self, key))
        if self.backend_affinity_block_chars < 16:
            raise ConfigError("worker.backend_affinity_block_chars",
                              f"must be at least 16, got {self.backend_affinity_block_chars}")
        if self.backend_affinity_wait_ms < 0:
            raise ConfigError("worker.backend_affinity_wait_ms",
                              f"must not be negative, got {self.backend_affinity_wait_ms}")
        if self.backend_metrics_stale_ms <= self.backend_metrics_interval_ms:
            raise ConfigError("worker.backend_metrics_stale_ms",
                              f"must be more than backend_metrics_interval_ms ({self.backend_metrics_interval_ms}), "
                              f"got {self.backend_metrics_stale_ms}")
