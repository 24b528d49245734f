"""[gateway]: the admission gateway (``llmq gateway``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from pipeline.errors import ConfigError
from pipeline.models import Priority


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
