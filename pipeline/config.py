"""Typed settings for every llmq process, from one TOML file plus environment overrides.

Precedence (lowest to highest): built-in defaults → the file named by ``--config`` or
``LLMQ_CONFIG`` → environment variables → explicit command-line flags.

Environment variables:

* ``LLMQ_BOOTSTRAP`` — shortcut for ``kafka.bootstrap``.
* ``LLMQ_<SECTION>__<KEY>`` — any scalar setting, e.g. ``LLMQ_WORKER__MAX_INFLIGHT=32``
  or ``LLMQ_TOPICS__PREFIX=staging.llm``.
* ``LLMQ_RDKAFKA_<NAME>`` — a librdkafka property passed through untouched to every
  client, with ``_`` read as ``.``: ``LLMQ_RDKAFKA_LINGER_MS=10`` sets ``linger.ms``.

Settings render the property dicts that confluent-kafka takes (``producer_config()``,
``consumer_config()``, ``admin_config()``); user properties from ``[kafka.properties]``
win over llmq's defaults, so any librdkafka knob is reachable.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from pipeline.errors import ConfigError
from pipeline.models import Priority
from pipeline.serde.limits import SerdeLimits

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

#: The local broker's JVM options. The JIT's optimising tier (C2) spends most of a core for the
#: first minute or two of a broker's life; a development broker is short-lived and shares two
#: cores with everything it serves, so it keeps to the quick tier (``make demo``'s CRITICAL
#: waits were several times longer without it).
DEFAULT_JVM_OPTIONS = "-XX:TieredStopAtLevel=1"

#: Worker pools (the seed's real-time / async / background queues): which bands each consumes.
DEFAULT_POOLS: dict[str, tuple[str, ...]] = {
    "realtime": ("CRITICAL", "HIGH"),
    "async": ("NORMAL", "LOW"),
    "background": ("BACKGROUND",),
    "all": ("CRITICAL", "HIGH", "NORMAL", "LOW", "BACKGROUND"),
}

# Properties llmq sets itself for correctness; users may still override them on purpose.
_PRODUCER_DEFAULTS = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 5,
    "compression.type": "lz4",
    # Java-compatible key hashing, so any Kafka client keyed by tenant lands on the same partition.
    "partitioner": "murmur2_random",
}
_CONSUMER_DEFAULTS = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "auto.offset.reset": "earliest",
    "partition.assignment.strategy": "cooperative-sticky",
    "fetch.wait.max.ms": 50,
}


_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_SASL_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN")


@dataclass
class KafkaSettings:
    bootstrap: str = DEFAULT_BOOTSTRAP
    client_id: str = "llmq"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "SCRAM-SHA-512"
    sasl_username: str = ""
    #: Prefer sasl_password_file; the password itself is never logged or shown in repr().
    sasl_password: str = field(default="", repr=False)
    sasl_password_file: str = ""
    #: CA bundle (PEM) that signed the brokers' certificates; hostname verification stays on.
    ssl_ca_location: str = ""
    #: librdkafka properties passed through untouched (``[kafka.properties]`` in the file).
    properties: dict[str, Any] = field(default_factory=dict, repr=False)

    def password(self) -> str:
        if self.sasl_password_file:
            try:
                return Path(self.sasl_password_file).expanduser().read_text().strip()
            except OSError as exc:
                raise ConfigError("kafka.sasl_password_file", f"cannot read it: {exc.strerror}") from None
        return self.sasl_password

    def common_config(self) -> dict[str, Any]:
        conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap, "client.id": self.client_id}
        if self.security_protocol != "PLAINTEXT":
            conf["security.protocol"] = self.security_protocol
        if self.security_protocol.startswith("SASL_"):
            conf["sasl.mechanism"] = self.sasl_mechanism
            conf["sasl.username"] = self.sasl_username
            conf["sasl.password"] = self.password()
        if self.security_protocol in ("SSL", "SASL_SSL") and self.ssl_ca_location:
            conf["ssl.ca.location"] = self.ssl_ca_location
        return conf

    def producer_config(self, **overrides: Any) -> dict[str, Any]:
        return {**self.common_config(), **_PRODUCER_DEFAULTS, **overrides, **self.properties}

    def consumer_config(self, group_id: str, **overrides: Any) -> dict[str, Any]:
        """An override of None removes the property (llmq's default included)."""
        conf = {
            **self.common_config(),
            **_CONSUMER_DEFAULTS,
            "group.id": group_id,
            **overrides,
            **self.properties,
        }
        return {k: v for k, v in conf.items() if v is not None}

    def aiokafka_config(self) -> dict[str, Any]:
        """The same connection settings for aiokafka (Faust's kafka:// driver)."""
        conf: dict[str, Any] = {"bootstrap_servers": self.bootstrap, "client_id": self.client_id,
                                "security_protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL_"):
            conf.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                        sasl_plain_password=self.password())
        if self.security_protocol in ("SSL", "SASL_SSL"):
            import ssl

            # Hostname verification and certificate checks stay on (the ssl module's defaults).
            conf["ssl_context"] = ssl.create_default_context(cafile=self.ssl_ca_location or None)
        return conf

    def admin_config(self) -> dict[str, Any]:
        # Producer/consumer-only properties make the admin client warn; keep only shared ones.
        shared = {k: v for k, v in self.properties.items()
                  if k.startswith(("security.", "sasl.", "ssl.", "socket.", "client."))}
        return {**self.common_config(), **shared}


@dataclass
class TopicSettings:
    prefix: str = "llm"
    request_partitions: int = 6
    response_partitions: int = 6
    dlq_partitions: int = 1
    replication_factor: int = 1
    request_config: dict[str, str] = field(default_factory=lambda: {"retention.ms": str(7 * 24 * 3600 * 1000)})
    response_config: dict[str, str] = field(default_factory=lambda: {"retention.ms": str(7 * 24 * 3600 * 1000)})
    cancellation_partitions: int = 3
    #: Admitted requests, per band, keyed by tenant: more partitions spread tenants wider, so
    #: a flooding tenant shares its partition with fewer quiet ones (stochastic fair queuing).
    dispatch_partitions: int = 12
    #: Compacted (one record per request id) and deleted after a day: cancelling is for live work.
    cancellation_config: dict[str, str] = field(default_factory=lambda: {
        "cleanup.policy": "compact,delete", "retention.ms": str(24 * 3600 * 1000)})
    #: max.message.bytes: a dead letter is the original message plus llmq's headers.
    dlq_config: dict[str, str] = field(default_factory=lambda: {"retention.ms": str(30 * 24 * 3600 * 1000),
                                                                "max.message.bytes": str(8 * 1024 * 1024 + 65536)})

    def request_topic(self, priority: Priority) -> str:
        return f"{self.prefix}.requests.{priority.value.lower()}"

    @property
    def request_topics(self) -> list[str]:
        return [self.request_topic(p) for p in Priority]

    def pool_topics(self, pool: str, source: str = "requests") -> list[str]:
        """The topics a worker of ``pool`` consumes: the gateway's dispatch topics, or the
        request topics themselves in the gateway-less set-up."""
        topic = self.dispatch_topic if source == "dispatch" else self.request_topic
        return [topic(Priority(band)) for band in DEFAULT_POOLS[pool]]

    def dispatch_topic(self, priority: Priority) -> str:
        return f"{self.prefix}.dispatch.{priority.value.lower()}"

    @property
    def dispatch_topics(self) -> list[str]:
        return [self.dispatch_topic(p) for p in Priority]

    @property
    def responses(self) -> str:
        return f"{self.prefix}.responses"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.dlq"

    @property
    def cancellations(self) -> str:
        return f"{self.prefix}.cancellations"


@dataclass
class SerdeSettings:
    max_record_bytes: int = SerdeLimits.max_record_bytes
    max_prompt_bytes: int = SerdeLimits.max_prompt_bytes
    max_metadata_entries: int = SerdeLimits.max_metadata_entries
    max_string_bytes: int = SerdeLimits.max_string_bytes
    max_output_bytes: int = SerdeLimits.max_output_bytes
    #: Confluent Schema Registry URL; empty means single-object encoding with local schemas.
    registry_url: str = ""
    #: Wire format for what llmq writes: "single-object" or "confluent" (needs registry_url).
    wire_format: str = "single-object"

    def limits(self) -> SerdeLimits:
        return SerdeLimits(
            max_record_bytes=self.max_record_bytes,
            max_prompt_bytes=self.max_prompt_bytes,
            max_metadata_entries=self.max_metadata_entries,
            max_string_bytes=self.max_string_bytes,
            max_output_bytes=self.max_output_bytes,
        )


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
    #: as soon as a message arrives; with calls in flight it sleeps this long between polls.
    idle_poll_ms: int = 5
    #: How long responses wait to be sent together (linger.ms of the worker's producer; a
    #: linger.ms in [kafka.properties] still wins). 1 ms takes ~4 ms off a response's way, at
    #: the cost of a produce request per response or two when they are sparse.
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
    #: librdkafka max.poll.interval.ms for workers; the loop never blocks on the backend.
    max_poll_interval_ms: int = 300_000
    #: How long a silent (crashed, frozen) worker keeps its partitions before the group moves them.
    #: Classic protocol: the consumer's session.timeout.ms. Consumer protocol: the group's
    #: consumer.session.timeout.ms, set by each worker at start (the broker bounds it with
    #: group.consumer.min/max.session.timeout.ms; if it refuses, its default applies, logged).
    session_timeout_ms: int = 45_000
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
    #: Fairness between tenants inside a band: while every slot is busy, a request whose tenant
    #: (the message key: the gateway and the llmq client key by tenant) runs no call in its band
    #: takes the slot of the most recently started call of a tenant running two or more in that
    #: band, which goes back to its queue behind it (max_preemptions bounds it too). Without it a
    #: flooding tenant holding every slot makes a quiet one wait for one of its calls to end.
    fair_preemption: bool = True
    #: Recent request ids a worker remembers, to answer a re-submitted id only once (0 = off).
    dedupe_window: int = 100_000
    #: Tenants that get their own metric label: these, plus the N busiest; the rest are "other".
    metrics_tenants: list[str] = field(default_factory=list)
    metrics_tenant_top_n: int = 10
    #: "requests": consume the request topics directly (gateway-less, small set-ups);
    #: "dispatch": consume what the gateway admitted (llm.dispatch.<band>).
    source: str = "requests"


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


@dataclass
class GatewaySettings:
    """The admission gateway (``llmq gateway``): see deploy/llmq.toml for every key explained."""

    app_id: str = "llmq-gateway"
    #: GET /v1/queue (JSON) and /metrics on this port; 0 = off.
    web_port: int = 6066
    web_host: str = "127.0.0.1"
    #: "at-least-once" only: a batch's offsets are committed after its outputs are delivered;
    #: a redelivered request is recognised by its id (see dedupe_horizon_ms).
    processing_guarantee: str = "at-least-once"
    #: Faust table store: memory:// only (rebuilt from the changelog topics at start). rocksdb://
    #: is refused: Faust's rocksdb store reads a key from the partition of the event being
    #: processed, and the gateway reads counters written from other partitions and topics.
    store: str = "memory://"
    #: Effective priority: band offset per user tier (negative = up), deadline urgency, load.
    tier_offsets: dict[str, int] = field(default_factory=lambda: {"enterprise": -1, "standard": 0, "free": 1})
    urgent_ms: int = 2_000
    urgent_eta_factor: float = 2.0
    high_load: float = 0.8
    #: Rate limits per tenant: name → {window_ms, requests, tokens, scope ("tenant"|"tenant_model")}.
    limits: dict[str, dict] = field(default_factory=lambda: {
        "per_second": {"window_ms": 1_000, "requests": 200, "tokens": 400_000},
        "per_minute": {"window_ms": 60_000, "requests": 6_000, "tokens": 12_000_000}})
    #: Per-tenant replacements of ``limits``: tenant → {name → {...}}.
    tenant_limits: dict[str, dict] = field(default_factory=dict)
    #: Fairness: most requests one tenant may have outstanding per band (0 = no cap); over it,
    #: demote down to ``demote_floor``, then refuse quota_exceeded.
    tenant_outstanding: dict[str, int] = field(default_factory=lambda: {
        "CRITICAL": 200, "HIGH": 500, "NORMAL": 2_000, "LOW": 5_000, "BACKGROUND": 20_000})
    tenant_outstanding_overrides: dict[str, dict] = field(default_factory=dict)
    demote_floor: str = "LOW"
    #: Bounded queues: most admitted-and-unfinished requests per band; over it, queue_full.
    queue_caps: dict[str, int] = field(default_factory=lambda: {
        "CRITICAL": 10_000, "HIGH": 20_000, "NORMAL": 50_000, "LOW": 100_000, "BACKGROUND": 200_000})
    #: The server's longest deadline: a client may shorten it, never extend it.
    max_timeout_ms: int = 600_000
    #: Graceful degradation above this load: simple requests that allow it get a smaller model.
    degrade_load: float = 0.8
    downgrade: dict[str, str] = field(default_factory=lambda: {"sim-large": "sim-small", "gpt-4o": "gpt-4o-mini"})
    simple_prompt_tokens: int = 1_000
    simple_max_tokens: int = 512
    #: Drain rate assumed before any completion was seen (requests/s; 0 = unknown).
    default_drain_rate: float = 0.0
    #: How long a request id is remembered, so a re-submitted id is answered once.
    dedupe_horizon_ms: int = 120_000
    #: The most requests admitted in one go. A batch is what has arrived, up to this many (it
    #: never waits to fill); table writes are made once per key and batch.
    batch_size: int = 200
    #: How long the tables' changes are gathered before they are written to their changelogs
    #: (each key once, with the partition and clock of its last change). Dispatches and answers
    #: go out at once; only the commit of the requests' offsets waits for the write, so a crash
    #: redoes what the changelogs do not have yet. At 1,000 req/s from 100 tenants every batch
    #: wrote ~1.6 changelog records per request, each a message for the broker. 0 = every batch.
    state_flush_ms: int = 200
    #: aiokafka: the longest a fetch waits when no data arrives. A fetch returns as soon as any
    #: of its partitions has data, so this is not a latency floor; it bounds the stall after a
    #: seek, resume or rebalance (faust hard-codes 1,500 ms). Short waits cost CPU: at 5 ms an
    #: idle gateway used 21 % of a core and its broker 15 % (3 % and 5 % at 100 ms), and at
    #: 1,000 req/s admission p99 was 66-80 ms (34 ms at 100).
    fetch_max_wait_ms: int = 100
    #: The fetch wait while records keep arriving: after a fetch that brought records the next
    #: one lets the broker gather for up to this long (or 1 MiB) instead of answering with the
    #: first record, so a steady stream is fetched in batches; after an empty fetch the next
    #: returns with the first record again. Every fetch names all the gateway's partitions and
    #: is encoded, answered and decoded in full: at 1,000 req/s one per arriving batch took a
    #: third of the gateway's CPU. 0 = always answer with the first record. 3 ms against 10:
    #: end-to-end p99 at 1,000 req/s 30-36 ms against 38-41, gateway 40 % of a core against 28,
    #: broker 70 % against 63; a quiet tenant next to a flooder in its band 28-30 ms against 36-38.
    busy_fetch_wait_ms: int = 3
    #: Incremental fetch sessions (KIP-227, pipeline.gateway.fetch_sessions): after the first
    #: fetch a request names only the partitions whose offsets moved and the broker answers only
    #: for partitions with records, instead of all of them every time (aiokafka sends no
    #: session). Less broker garbage (tenant_fairness: 25-27 young pauses against 37 in the
    #: same hour) and a few percent of a core less at gateway and broker. One flooded
    #: benchmark round with it on held a quiet tenant for 8.9 s, cause not found and not seen
    #: again in 53 flooded rounds since (BENCHMARKS.md); false is aiokafka's own fetching.
    fetch_sessions: bool = True
    #: Bands whose requests end that gathering: for a second after a fetch brought one of
    #: them, every fetch answers with the first record again. One fetch names every partition,
    #: so gathering behind a BACKGROUND flood held a sparse CRITICAL request back too. [] = none.
    prompt_fetch_bands: list[str] = field(default_factory=lambda: ["CRITICAL", "HIGH"])
    #: How long outputs wait to be sent together. Every produce request costs the broker CPU
    #: (here a 1,000 msg/s stream took 41 % of a core at 1 ms, 30 % at 5 ms). For latency, 1 ms
    #: on every producer of the path (client, gateway, worker.producer_linger_ms) gave an
    #: end-to-end p99 at 1,000 req/s of 40-48 ms against 51-59 ms at 5 ms (BENCHMARKS.md;
    #: an earlier, noisier measurement had found 1 ms worse).
    producer_linger_ms: int = 5
    #: The linger of BACKGROUND dispatches and of the tables' changelog writes, sent
    #: by a second producer: librdkafka sends one produce request per partition, so a flood of
    #: bulk work at 5 ms is about a request per message for the broker the urgent bands share.
    #: 0 = one producer for everything.
    bulk_linger_ms: int = 50
    #: How long the group waits for a gateway that stopped heartbeating (crashed, killed, its
    #: host gone) before its request partitions go to another gateway, or back to it when it
    #: restarts: admission from those partitions stops for that long. Faust's default is 60 s.
    #: Heartbeats come from the consumer's own thread (every fifth of this), so a long batch
    #: on the event loop does not miss them. The broker bounds it with
    #: group.min/max.session.timeout.ms (6 s to 30 min by default).
    session_timeout_ms: int = 10_000
    #: Static group membership (group.instance.id), e.g. the pod name of a StatefulSet: a
    #: gateway restarted under the same id within session_timeout_ms takes its partitions
    #: back at once, and no other gateway's move. One that stops for good keeps its partitions
    #: until the session times out (a static member does not leave the group on SIGTERM), so
    #: scale-downs wait that long. Empty (the default) = dynamic membership.
    instance_id: str = ""

    # -- the policies these settings describe (also validates them, naming the bad key) ---

    def window_limits(self) -> tuple[list, dict[str, list]]:
        from pipeline.policy.ratelimit import WindowLimit

        def build(path: str, table: Any) -> list:
            if not isinstance(table, Mapping):
                raise ConfigError(path, "must be a table of named limits")
            out = []
            for name, spec in table.items():
                if not isinstance(spec, Mapping):
                    raise ConfigError(f"{path}.{name}", "must be a table {window_ms, requests, tokens, scope}")
                unknown = set(spec) - {"window_ms", "requests", "tokens", "scope"}
                if unknown:
                    raise ConfigError(f"{path}.{name}.{sorted(unknown)[0]}", "unknown key (known: window_ms, "
                                                                            "requests, tokens, scope)")
                try:
                    out.append(WindowLimit(str(name), int(spec.get("window_ms", 0)), int(spec.get("requests", 0)),
                                           int(spec.get("tokens", 0)), str(spec.get("scope", "tenant"))))
                except (TypeError, ValueError) as exc:
                    raise ConfigError(f"{path}.{name}", str(exc)) from None
            return out

        default = build("gateway.limits", self.limits)
        per_tenant = {t: build(f"gateway.tenant_limits.{t}", v) for t, v in self.tenant_limits.items()}
        return default, per_tenant

    def priority_policy(self):
        from pipeline.policy.priority import PriorityPolicy

        offsets = {}
        for tier, off in self.tier_offsets.items():
            try:
                offsets[tier] = int(off)
            except (TypeError, ValueError):
                raise ConfigError(f"gateway.tier_offsets.{tier}", f"must be an integer, got {off!r}") from None
            if not -4 <= offsets[tier] <= 4:
                raise ConfigError(f"gateway.tier_offsets.{tier}", "must be between -4 and 4")
        return PriorityPolicy(tier_offsets=offsets, urgent_ms=self.urgent_ms,
                              urgent_eta_factor=self.urgent_eta_factor, high_load=self.high_load)

    def band_ints(self, key: str) -> dict[str, int]:
        table = getattr(self, key)
        out = {}
        for band, value in table.items():
            if band not in Priority.__members__:
                raise ConfigError(f"gateway.{key}.{band}", f"unknown band (known: {', '.join(Priority.__members__)})")
            try:
                out[band] = int(value)
            except (TypeError, ValueError):
                raise ConfigError(f"gateway.{key}.{band}", f"must be an integer, got {value!r}") from None
            if out[band] < 0:
                raise ConfigError(f"gateway.{key}.{band}", "must be >= 0")
        return out

    def validate(self) -> None:
        self.window_limits()
        self.priority_policy()
        self.band_ints("tenant_outstanding")
        self.band_ints("queue_caps")
        for tenant, caps in self.tenant_outstanding_overrides.items():
            if not isinstance(caps, Mapping):
                raise ConfigError(f"gateway.tenant_outstanding_overrides.{tenant}", "must be a table band → cap")
        if self.demote_floor not in Priority.__members__:
            raise ConfigError("gateway.demote_floor", f"unknown band (known: {', '.join(Priority.__members__)})")
        for band in self.prompt_fetch_bands:
            if band not in Priority.__members__:
                raise ConfigError("gateway.prompt_fetch_bands",
                                  f"unknown band {band!r} (known: {', '.join(Priority.__members__)})")
        if self.processing_guarantee != "at-least-once":
            # faust-streaming 0.15's exactly_once leaves sends to topics the app does not consume
            # outside its transactions, and the dispatch topics are such topics.
            raise ConfigError("gateway.processing_guarantee", "only 'at-least-once' is supported: re-admitted "
                                                               "requests are recognised by id instead")
        if not self.store.startswith("memory://"):
            raise ConfigError("gateway.store", "must be memory:// (the tables are rebuilt from their changelog "
                                               "topics at start); rocksdb:// is not supported: Faust's rocksdb "
                                               "store reads from the current event's partition only")
        for key in ("max_timeout_ms", "urgent_eta_factor", "batch_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"gateway.{key}", f"must be > 0, got {getattr(self, key)!r}")
        for key in ("high_load", "degrade_load"):
            if not 0 < getattr(self, key) <= 10:
                raise ConfigError(f"gateway.{key}", "must be a fraction of capacity, > 0 (0.8 = 80%)")
        for key in ("urgent_ms", "simple_prompt_tokens", "simple_max_tokens", "default_drain_rate", "dedupe_horizon_ms",
                    "fetch_max_wait_ms", "busy_fetch_wait_ms", "producer_linger_ms", "bulk_linger_ms",
                    "state_flush_ms"):
            if getattr(self, key) < 0:
                raise ConfigError(f"gateway.{key}", f"must be >= 0, got {getattr(self, key)!r}")
        if not 0 <= self.web_port < 65536:
            raise ConfigError("gateway.web_port", f"must be a TCP port or 0 (off), got {self.web_port}")
        if self.session_timeout_ms < 1_000:
            raise ConfigError("gateway.session_timeout_ms", f"must be >= 1000, got {self.session_timeout_ms!r}")
        if self.instance_id and (len(self.instance_id) > 249 or not self.instance_id.isprintable()):
            raise ConfigError("gateway.instance_id", "must be at most 249 printable characters")
        for small, large in self.downgrade.items():
            if not isinstance(large, str) or not large:
                raise ConfigError(f"gateway.downgrade.{small}", "must name the smaller model")


@dataclass
class BrokerSettings:
    """The local development broker started by ``llmq broker up``."""

    port: int = 9092
    data_dir: str = ".llmq/kafka"
    heap: str = "768m"
    kafka_version: str = "4.4.0"
    #: Where the Kafka jars are cached; empty = $XDG_CACHE_HOME/llmq or ~/.cache/llmq.
    cache_dir: str = ""
    #: More JVM options for the broker, space-separated (as KAFKA_OPTS of Kafka's scripts);
    #: the default keeps the JIT to its quick tier (why: DEFAULT_JVM_OPTIONS above).
    jvm_options: str = DEFAULT_JVM_OPTIONS


@dataclass
class Settings:
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    topics: TopicSettings = field(default_factory=TopicSettings)
    serde: SerdeSettings = field(default_factory=SerdeSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    broker: BrokerSettings = field(default_factory=BrokerSettings)

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> "Settings":
        """Defaults, then the TOML file (``path`` or ``$LLMQ_CONFIG``), then the environment."""
        env = os.environ if env is None else env
        settings = cls()
        path = path or env.get("LLMQ_CONFIG") or None
        if path:
            p = Path(path)
            if not p.is_file():
                raise ConfigError("LLMQ_CONFIG", f"config file {str(p)!r} does not exist")
            try:
                data = tomllib.loads(p.read_text())
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(str(p), f"not valid TOML: {exc}") from exc
            settings._apply_mapping(data)
        settings._apply_env(env)
        settings.validate()
        return settings

    def _apply_mapping(self, data: Mapping[str, Any]) -> None:
        sections = {f.name for f in dataclasses.fields(self)}
        for section, values in data.items():
            if section not in sections:
                raise ConfigError(section, f"unknown section (known: {', '.join(sorted(sections))})")
            if not isinstance(values, Mapping):
                raise ConfigError(section, "must be a table")
            target = getattr(self, section)
            for key, value in values.items():
                _set_field(target, f"{section}.{key}", key, value, from_env=False)

    def _apply_env(self, env: Mapping[str, str]) -> None:
        if env.get("LLMQ_BOOTSTRAP"):
            self.kafka.bootstrap = env["LLMQ_BOOTSTRAP"]
        for name, raw in env.items():
            if name.startswith("LLMQ_RDKAFKA_"):
                prop = name[len("LLMQ_RDKAFKA_"):].lower().replace("_", ".")
                self.kafka.properties[prop] = raw
            elif name.startswith("LLMQ_") and "__" in name:
                section, _, key = name[len("LLMQ_"):].lower().partition("__")
                if not hasattr(self, section) or section.startswith("_"):
                    raise ConfigError(name, f"unknown section {section!r}")
                _set_field(getattr(self, section), name, key, raw, from_env=True)

    def validate(self) -> None:
        def positive(key: str, value: float) -> None:
            if value <= 0:
                raise ConfigError(key, f"must be > 0, got {value!r}")

        def non_negative(key: str, value: float) -> None:
            if value < 0:
                raise ConfigError(key, f"must be >= 0, got {value!r}")

        if not self.kafka.bootstrap.strip():
            raise ConfigError("kafka.bootstrap", "must not be empty")
        k = self.kafka
        if k.security_protocol not in _SECURITY_PROTOCOLS:
            raise ConfigError("kafka.security_protocol", f"must be one of {', '.join(_SECURITY_PROTOCOLS)}")
        if k.security_protocol.startswith("SASL_"):
            if k.sasl_mechanism not in _SASL_MECHANISMS:
                raise ConfigError("kafka.sasl_mechanism", f"must be one of {', '.join(_SASL_MECHANISMS)}")
            if not k.sasl_username:
                raise ConfigError("kafka.sasl_username", f"required with security_protocol {k.security_protocol}")
            if not (k.sasl_password or k.sasl_password_file):
                raise ConfigError("kafka.sasl_password_file",
                                  "a password (kafka.sasl_password_file, or LLMQ_KAFKA__SASL_PASSWORD) is required")
            if k.sasl_mechanism == "PLAIN" and k.security_protocol == "SASL_PLAINTEXT":
                raise ConfigError("kafka.sasl_mechanism", "PLAIN over SASL_PLAINTEXT sends the password in clear "
                                                          "text; use SASL_SSL")
        if k.ssl_ca_location and not Path(k.ssl_ca_location).expanduser().is_file():
            raise ConfigError("kafka.ssl_ca_location", f"no such file {k.ssl_ca_location!r}")
        for key in ("request_partitions", "response_partitions", "dlq_partitions", "cancellation_partitions",
                    "replication_factor"):
            positive(f"topics.{key}", getattr(self.topics, key))
        if not self.topics.prefix or any(c.isspace() for c in self.topics.prefix):
            raise ConfigError("topics.prefix", "must be a non-empty name without spaces")
        for key in ("max_record_bytes", "max_prompt_bytes", "max_metadata_entries", "max_string_bytes", "max_output_bytes"):
            positive(f"serde.{key}", getattr(self.serde, key))
        if self.serde.max_record_bytes < 4096:
            # A FAILED response carrying only ids and a reason must always fit.
            raise ConfigError("serde.max_record_bytes", f"must be >= 4096, got {self.serde.max_record_bytes}")
        if self.serde.wire_format not in ("single-object", "confluent"):
            raise ConfigError("serde.wire_format", "must be 'single-object' or 'confluent'")
        if self.serde.wire_format == "confluent" and not self.serde.registry_url:
            raise ConfigError("serde.registry_url", "required when serde.wire_format = 'confluent'")
        for key in ("max_inflight", "batch_size", "commit_interval_ms", "idle_poll_ms", "max_poll_interval_ms",
                    "session_timeout_ms"):
            positive(f"worker.{key}", getattr(self.worker, key))
        for key in ("shutdown_grace_s", "sim_latency_ms", "sim_ms_per_token", "metrics_tenant_top_n", "dedupe_window"):
            non_negative(f"worker.{key}", getattr(self.worker, key))
        non_negative("worker.producer_linger_ms", self.worker.producer_linger_ms)
        shares = {}
        for band, share in self.worker.band_min_share.items():
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
        self.worker.band_min_share = shares
        for band in self.worker.preempt_bands:
            if band not in Priority.__members__:
                raise ConfigError("worker.preempt_bands", f"unknown band {band!r} (known: {', '.join(Priority.__members__)})")
        if Priority.CRITICAL.value in self.worker.preempt_bands:
            raise ConfigError("worker.preempt_bands", "CRITICAL has no higher band to give way to")
        non_negative("worker.max_preemptions", self.worker.max_preemptions)
        if self.worker.group_protocol not in ("consumer", "classic"):
            raise ConfigError("worker.group_protocol", "must be 'consumer' (KIP-848, Kafka >= 4.0) or 'classic'")
        if not self.worker.group_remote_assignor:
            raise ConfigError("worker.group_remote_assignor", "must name a broker-side assignor, e.g. 'range'")
        if self.worker.delivery not in ("at-least-once", "exactly-once"):
            raise ConfigError("worker.delivery", "must be 'at-least-once' or 'exactly-once'")
        positive("worker.transaction_timeout_ms", self.worker.transaction_timeout_ms)
        if self.worker.pool not in DEFAULT_POOLS:
            raise ConfigError("worker.pool", f"unknown pool {self.worker.pool!r} (known: {', '.join(DEFAULT_POOLS)})")
        if self.worker.backend not in ("simulated", "openai"):
            raise ConfigError("worker.backend", f"unknown backend {self.worker.backend!r} (known: simulated, openai)")
        if self.worker.backend == "openai" and not self.worker.openai_base_url.startswith(("http://", "https://")):
            raise ConfigError("worker.openai_base_url", "must be an http:// or https:// URL")
        positive("worker.backend_timeout_s", self.worker.backend_timeout_s)
        positive("worker.backend_max_attempts", self.worker.backend_max_attempts)
        if not 0 <= self.worker.metrics_port < 65536:
            raise ConfigError("worker.metrics_port", f"must be a TCP port or 0 (off), got {self.worker.metrics_port}")
        if self.worker.source not in ("requests", "dispatch"):
            raise ConfigError("worker.source", "must be 'requests' (gateway-less) or 'dispatch' (behind the gateway)")
        positive("topics.dispatch_partitions", self.topics.dispatch_partitions)
        self.gateway.validate()
        if not 0 < self.broker.port < 65536:
            raise ConfigError("broker.port", f"must be a TCP port, got {self.broker.port}")


def _set_field(target: Any, key_path: str, key: str, value: Any, *, from_env: bool) -> None:
    fields = {f.name: f for f in dataclasses.fields(target)}
    if key not in fields:
        raise ConfigError(key_path, f"unknown setting (known: {', '.join(sorted(fields))})")
    hints = typing.get_type_hints(type(target))
    setattr(target, key, _coerce(key_path, hints[key], value, from_env))


def _coerce(key_path: str, hint: Any, value: Any, from_env: bool) -> Any:
    origin = typing.get_origin(hint)
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        if hint is str:
            if not isinstance(value, str):
                raise ValueError("expected a string")
            return value
        if origin is list:
            if from_env:
                return [item.strip() for item in str(value).split(",") if item.strip()]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError("expected a list of strings")
            return list(value)
        if origin is dict:
            if from_env:
                # "k=v,k2=v2" in the environment
                pairs = [item.split("=", 1) for item in str(value).split(",") if item.strip()]
                if any(len(p) != 2 for p in pairs):
                    raise ValueError("expected k=v,k2=v2")
                return {k.strip(): v.strip() for k, v in pairs}
            if not isinstance(value, Mapping):
                raise ValueError("expected a table")
            return dict(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(key_path, f"{exc} (got {value!r})") from None
    raise ConfigError(key_path, f"unsupported setting type {hint!r}")
