"""[gateway]: the admission gateway (``llmq gateway``); deploy/llmq.toml explains every key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from pipeline.config.fields import BAND_NAMES, check_band, non_negative
from pipeline.errors import ConfigError
from pipeline.models import Priority

_LIMIT_KEYS = ("window_ms", "requests", "tokens", "scope", "burst", "token_burst", "over")
PROCESSING_GUARANTEES = ("at-least-once", "exactly-once")
#: What [gateway.shadow] may replace: the limits an operator tries out before enforcing them.
SHADOW_KEYS = ("limits", "tenant_limits", "tenant_outstanding", "tenant_outstanding_overrides", "queue_caps")


@dataclass(frozen=True)
class RateLimitSettings:
    """One named token bucket pair: ``requests`` requests and ``tokens`` tokens per ``window_ms``
    (0 = no such cap), bursts of ``burst`` requests / ``token_burst`` tokens (0 = one window's
    worth), per tenant or per tenant and model (``scope``). ``over``: what becomes of a request
    over the limit: "delay" (admitted to start when the bucket has room for it, unless that is
    past its deadline or ``gateway.rate_limit_max_delay_ms``) or "refuse" (rate_limited at once)."""

    name: str
    window_ms: int
    requests: int = 0
    tokens: int = 0
    scope: str = "tenant"
    burst: int = 0
    token_burst: int = 0
    over: str = "delay"

    @property
    def request_burst(self) -> int:
        return self.burst or self.requests

    @property
    def tokens_burst(self) -> int:
        return self.token_burst or self.tokens

    def check(self, path: str) -> None:
        if self.window_ms <= 0:
            raise ConfigError(f"{path}.window_ms", "must be > 0")
        if self.requests < 0 or self.tokens < 0 or (self.requests == 0 and self.tokens == 0):
            raise ConfigError(path, "set requests and/or tokens > 0")
        if self.scope not in ("tenant", "tenant_model"):
            raise ConfigError(f"{path}.scope", "must be 'tenant' or 'tenant_model'")
        if self.burst < 0 or self.token_burst < 0:
            raise ConfigError(path, "burst and token_burst must be >= 0")
        if self.over not in ("delay", "refuse"):
            raise ConfigError(f"{path}.over", "must be 'delay' (shape: start it when the bucket has room) or 'refuse'")
        if "\x1f" in self.name or not self.name:
            raise ConfigError(path, "a limit needs a plain name")


def _limits(path: str, table: Any) -> list[RateLimitSettings]:
    if not isinstance(table, Mapping):
        raise ConfigError(path, "must be a table of named limits")
    out = []
    for name, spec in table.items():
        if isinstance(spec, RateLimitSettings):
            out.append(spec)
            continue
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{path}.{name}", "must be a table {" + ", ".join(_LIMIT_KEYS) + "}")
        unknown = set(spec) - set(_LIMIT_KEYS)
        if unknown:
            raise ConfigError(f"{path}.{name}.{sorted(unknown)[0]}", f"unknown key (known: {', '.join(_LIMIT_KEYS)})")
        try:
            limit = RateLimitSettings(str(name), int(spec.get("window_ms", 0)), int(spec.get("requests", 0)),
                                      int(spec.get("tokens", 0)), str(spec.get("scope", "tenant")),
                                      int(spec.get("burst", 0)), int(spec.get("token_burst", 0)),
                                      str(spec.get("over", "delay")))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{path}.{name}", f"must be integers ({exc})") from None
        limit.check(f"{path}.{name}")
        out.append(limit)
    return out


def _check_overrides(path: str, overrides: Mapping) -> None:
    for tenant, caps in overrides.items():
        if not isinstance(caps, Mapping):
            raise ConfigError(f"{path}.{tenant}", "must be a table band → cap")
        for band in caps:
            check_band(f"{path}.{tenant}.{band}", band)


@dataclass
class GatewaySettings:
    """The admission gateway (``llmq gateway``)."""

    app_id: str = "llmq-gateway"
    #: GET /v1/queue (JSON) and /metrics on this port; 0 = off.
    web_port: int = 6066
    web_host: str = "127.0.0.1"
    #: "at-least-once": a request's offset is committed once its outputs are delivered and its
    #: tenant's state is written; after a crash, what was not committed is admitted again (its
    #: outputs sent again). "exactly-once": outputs and offsets commit in one transaction per
    #: request partition (pipeline/gateway/transactions.py); read_committed readers see no repeat.
    processing_guarantee: str = "at-least-once"
    #: Effective priority: band offset per user tier (negative = up), deadline urgency, load.
    tier_offsets: dict[str, int] = field(default_factory=lambda: {"enterprise": -1, "standard": 0, "free": 1})
    urgent_ms: int = 2_000
    urgent_eta_factor: float = 2.0
    #: Load (a band's waits over target_queue_ms; at most 10) at or above which non-critical work
    #: moves down a band; above 10 never. Only the work of tenants holding at least
    #: load_spared_share of the band's queue moves: the others did not load it.
    high_load: float = 0.8
    load_spared_share: float = 0.1
    #: How much queued work, in time at the current drain rate, counts as full load (1.0).
    target_queue_ms: int = 2_000
    #: Token buckets per tenant: name → {window_ms, requests, tokens, burst, token_burst, scope, over}.
    limits: dict[str, Any] = field(default_factory=lambda: {
        "per_second": {"window_ms": 1_000, "requests": 200, "tokens": 400_000},
        "per_minute": {"window_ms": 60_000, "requests": 6_000, "tokens": 12_000_000}})
    #: The longest a request over a "delay" limit is held back (its deadline bounds it too);
    #: one that would wait longer is refused rate_limited with a retry-after.
    rate_limit_max_delay_ms: int = 30_000
    #: A request read at most this long after a later arrival of its tenant (band topics are not
    #: read in arrival order; a failover's backlog) is judged at its own arrival, so the limits
    #: hold over every interval of arrivals; an older one meets the buckets as they are now.
    rate_limit_reorder_ms: int = 10_000
    #: Per-tenant replacements of ``limits``: tenant → {name → {...}}.
    tenant_limits: dict[str, Any] = field(default_factory=dict)
    #: Fairness: most requests one tenant may have outstanding per band (0 = no cap); over it,
    #: demote down to ``demote_floor``, then refuse quota_exceeded.
    tenant_outstanding: dict[str, int] = field(default_factory=lambda: {
        "CRITICAL": 200, "HIGH": 500, "NORMAL": 2_000, "LOW": 5_000, "BACKGROUND": 20_000})
    tenant_outstanding_overrides: dict[str, dict] = field(default_factory=dict)
    demote_floor: str = "LOW"
    #: Bounded queues: most requests waiting per band (the dispatch topic's depth, over every
    #: gateway); over it, queue_full with a retry-after from the drain rate.
    queue_caps: dict[str, int] = field(default_factory=lambda: {
        "CRITICAL": 10_000, "HIGH": 20_000, "NORMAL": 50_000, "LOW": 100_000, "BACKGROUND": 200_000})
    #: How often the band depths and rates are read from the dispatch topics' offsets.
    depth_refresh_ms: int = 500
    #: The consumer groups of the workers behind the gateway, whose commits on the dispatch topics
    #: drain the queues; [] = the groups [worker] names (worker.group_id, or llmq-pool-<pool>).
    worker_groups: list[str] = field(default_factory=list)
    #: The server's longest deadline: a client may shorten it, never extend it.
    max_timeout_ms: int = 600_000
    #: Answer EXPIRED at admission a request whose deadline falls before even the shortest wait
    #: that recent, saturated drain readings allow (docs/gateway.md, "Queue position and ETA").
    #: Off: every such request is dispatched, and a worker expires it if it has not started by
    #: its deadline.
    early_expiry: bool = True
    #: Graceful degradation at or above this load: simple requests that allow it get a smaller model.
    degrade_load: float = 0.8
    downgrade: dict[str, str] = field(default_factory=lambda: {"sim-large": "sim-small", "gpt-4o": "gpt-4o-mini"})
    simple_prompt_tokens: int = 1_000
    simple_max_tokens: int = 512
    #: The workers' capacity assumed before any was measured (requests/s; 0 = unknown: no ETA yet).
    default_drain_rate: float = 0.0
    #: How long a request id is remembered, so a re-submitted id is answered once.
    dedupe_horizon_ms: int = 120_000
    #: How long the decisions made meanwhile are gathered before they are written (the ids seen,
    #: one record per request partition). Answers leave once their decision is written, so this
    #: adds to every answer's latency; while a write is in flight the next decisions gather
    #: anyway, so a little goes a long way. Longer: fewer changelog records.
    decision_flush_ms: int = 2
    #: How often the changed tenant records are written (each once): what a crash makes the
    #: gateway redo, and how far commits trail the admissions.
    state_flush_ms: int = 1000
    #: How long outputs wait to be sent together (linger.ms of the gateway's producer).
    producer_linger_ms: int = 2
    #: The longest the broker holds the gateway's fetch when its partitions have nothing new
    #: (fetch.max.wait.ms). The consumer keeps one fetch in flight and leaves out of it the
    #: partitions whose records it still holds, so this is also how long a busy band can wait
    #: behind a fetch of idle ones: what a request's admission may wait on top. Faust
    #: hard-codes 1500; llmq sets it through one shim (gateway/faust_compat.py). Shorter:
    #: more empty fetches on an idle broker (1000 / this a second per gateway).
    fetch_max_wait_ms: int = 10
    #: How much a fetch waits for (fetch.min.bytes), up to fetch_max_wait_ms. 1 (aiokafka's and
    #: Faust's): a fetch returns with the first record, so under a trickle of requests every
    #: record or two costs a fetch, built and decoded in Python for every assigned partition.
    #: More: one fetch gathers what arrives within fetch_max_wait_ms, for up to that much on an
    #: admission (docs/performance.md).
    fetch_min_bytes: int = 65_536
    #: How long the group waits for a gateway that stopped heartbeating (crashed, killed, its
    #: host gone) before its request partitions go to another gateway: most of a failover, which
    #: takes about a second more. Faust's default is 60 s. Heartbeats go every fifth of it, so a
    #: gateway whose event loop stalls for longer than about this is taken for dead. The broker
    #: bounds it with group.min/max.session.timeout.ms (6 s to 30 min unless set; `llmq broker`
    #: and the compose file allow 1 s); a gateway asking for less joins with the broker's minimum
    #: and says so (gateway/membership.py).
    session_timeout_ms: int = 3_000
    #: Liveness (GET /healthz): a request or response partition with records waiting and no
    #: event consumed from it for this long is stalled. The gateway seeks it to its position once
    #: (Faust's consumer), and if it is still stalled this much later, exits for its supervisor to
    #: restart it (aiokafka's fetcher can stop after a node dies while the group heartbeats on;
    #: pipeline/gateway/stall_watch.py). 0 = no progress watch.
    stall_s: float = 30.0
    #: Static group membership (group.instance.id), e.g. the pod name of a StatefulSet: a
    #: gateway restarted under the same id within session_timeout_ms takes its partitions
    #: back at once. One that stops for good keeps its partitions until the session times out.
    #: Empty (the default) = dynamic membership.
    instance_id: str = ""
    #: Shadow limits: any of SHADOW_KEYS, replacing the key of the same name in a second policy
    #: that judges every request beside the real one. Its verdicts are only counted
    #: (llmq_gateway_shadow_decisions_total); admission follows the real policy. {} = off.
    shadow: dict[str, Any] = field(default_factory=dict)

    # -- typed views of the tables above (also what validate() checks) -------------------

    def rate_limits(self) -> tuple[list[RateLimitSettings], dict[str, list[RateLimitSettings]]]:
        default = _limits("gateway.limits", self.limits)
        per_tenant = {t: _limits(f"gateway.tenant_limits.{t}", v) for t, v in self.tenant_limits.items()}
        return default, per_tenant

    def band_ints(self, key: str, section: str = "gateway") -> dict[str, int]:
        out = {}
        table = getattr(self, key)
        if not isinstance(table, Mapping):
            raise ConfigError(f"{section}.{key}", "must be a table band → integer")
        for band, value in table.items():
            check_band(f"{section}.{key}.{band}", band)
            try:
                out[band] = int(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{section}.{key}.{band}", f"must be an integer, got {value!r}") from None
            if out[band] < 0:
                raise ConfigError(f"{section}.{key}.{band}", "must be >= 0")
        return out

    def shadow_policy(self) -> "GatewaySettings | None":
        """The settings of the shadow policy: these, with [gateway.shadow]'s keys replaced (None: no shadow)."""
        if not self.shadow:
            return None
        return dataclasses.replace(self, shadow={}, **{k: dict(v) for k, v in self.shadow.items()})

    def _check_shadow(self) -> None:
        for key, value in self.shadow.items():
            if key not in SHADOW_KEYS:
                raise ConfigError(f"gateway.shadow.{key}", f"cannot be shadowed (known: {', '.join(SHADOW_KEYS)})")
            if not isinstance(value, Mapping):
                raise ConfigError(f"gateway.shadow.{key}", f"must be a table, as gateway.{key} is")
        shadow = self.shadow_policy()
        if shadow is None:
            return
        _limits("gateway.shadow.limits", shadow.limits)
        for tenant, table in shadow.tenant_limits.items():
            _limits(f"gateway.shadow.tenant_limits.{tenant}", table)
        shadow.band_ints("tenant_outstanding", "gateway.shadow")
        shadow.band_ints("queue_caps", "gateway.shadow")
        _check_overrides("gateway.shadow.tenant_outstanding_overrides", shadow.tenant_outstanding_overrides)

    def validate(self) -> None:
        self.rate_limits()
        for tier, off in self.tier_offsets.items():
            if not isinstance(off, int) or isinstance(off, bool) or not -4 <= off <= 4:
                raise ConfigError(f"gateway.tier_offsets.{tier}", f"must be an integer between -4 and 4, got {off!r}")
        self.band_ints("tenant_outstanding")
        self.band_ints("queue_caps")
        _check_overrides("gateway.tenant_outstanding_overrides", self.tenant_outstanding_overrides)
        self._check_shadow()
        if self.demote_floor not in Priority.__members__:
            raise ConfigError("gateway.demote_floor", f"unknown band (known: {BAND_NAMES})")
        if self.processing_guarantee not in PROCESSING_GUARANTEES:
            raise ConfigError("gateway.processing_guarantee",
                              f"must be one of {', '.join(PROCESSING_GUARANTEES)}, got {self.processing_guarantee!r}")
        if self.decision_flush_ms < 0:
            raise ConfigError("gateway.decision_flush_ms", f"must be >= 0, got {self.decision_flush_ms!r}")
        non_negative("gateway.rate_limit_max_delay_ms", self.rate_limit_max_delay_ms)
        non_negative("gateway.rate_limit_reorder_ms", self.rate_limit_reorder_ms)
        for key in ("max_timeout_ms", "urgent_eta_factor", "target_queue_ms", "depth_refresh_ms", "state_flush_ms"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"gateway.{key}", f"must be > 0, got {getattr(self, key)!r}")
        if not 0 <= self.load_spared_share <= 1:
            raise ConfigError("gateway.load_spared_share", f"must be a share from 0 (spare nobody) to 1, "
                                                           f"got {self.load_spared_share!r}")
        for key in ("high_load", "degrade_load"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"gateway.{key}", "must be a load above 0 (1.0 = waits of target_queue_ms; "
                                                    "the load never exceeds 10, so more turns it off)")
        for key in ("urgent_ms", "simple_prompt_tokens", "simple_max_tokens", "default_drain_rate", "dedupe_horizon_ms",
                    "producer_linger_ms"):
            if getattr(self, key) < 0:
                raise ConfigError(f"gateway.{key}", f"must be >= 0, got {getattr(self, key)!r}")
        if not 0 <= self.web_port < 65536:
            raise ConfigError("gateway.web_port", f"must be a TCP port or 0 (off), got {self.web_port}")
        if not 1 <= self.fetch_min_bytes <= 52_428_800:
            raise ConfigError("gateway.fetch_min_bytes", f"must be from 1 to 52428800, got {self.fetch_min_bytes!r}")
        if not 1 <= self.fetch_max_wait_ms <= 30_000:
            raise ConfigError("gateway.fetch_max_wait_ms", f"must be from 1 to 30000, got {self.fetch_max_wait_ms!r}")
        if self.stall_s < 0:
            raise ConfigError("gateway.stall_s", f"must be >= 0 (0 = no progress watch), got {self.stall_s!r}")
        if self.session_timeout_ms < 1_000:
            raise ConfigError("gateway.session_timeout_ms", f"must be >= 1000, got {self.session_timeout_ms!r}")
        if self.instance_id and (len(self.instance_id) > 249 or not self.instance_id.isprintable()):
            raise ConfigError("gateway.instance_id", "must be at most 249 printable characters")
        for small, large in self.downgrade.items():
            if not isinstance(large, str) or not large:
                raise ConfigError(f"gateway.downgrade.{small}", "must name the smaller model")
