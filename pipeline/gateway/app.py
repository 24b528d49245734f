"""`llmq gateway`: a Faust app that admits requests from the five request topics.

* One agent per request topic (``admit-<band>``) hands each request to the
  :class:`~pipeline.gateway.intake.Intake`: decode (undecodable → dead-letter topic), recognise a
  re-submitted or redelivered id, the pure admission decision (:mod:`pipeline.policy.admission`);
  admitted requests go to ``<prefix>.dispatch.<band>`` with their admission time, effective
  priority and (if degraded) the model asked for; refusals, expirations and cancellations go to
  the response topic with their reason and ``retry_after_ms``. Within each fetch the consumer
  hands CRITICAL's records over first (:class:`BandFirst`, Faust's ``ConsumerScheduler``).
* One agent over the response topic (``completions``) counts dispatched requests finished.
* State is in two Faust tables with changelogs, keyed by tenant and co-partitioned with the
  request and response topics (:mod:`pipeline.gateway.partitions`): ``tenants`` (token buckets,
  outstanding requests per band) and ``seen`` (the recent request ids).
* The band queues are the dispatch topics; their depths come from the broker
  (:mod:`pipeline.gateway.depths`), the same for every gateway instance.
* :class:`~pipeline.gateway.checkpoint.DecisionCheckpoint`: outputs leave only after the decision
  behind them is in the changelogs, and a request is acknowledged only after its outputs are
  delivered and its tenant's state is written; the agents' streams are ``noack()`` for that.
  Exactly-once (``gateway.processing_guarantee``), the outputs and the offsets behind them commit
  in one transaction per request partition instead (:mod:`pipeline.gateway.transactions`).

Everything goes through Faust's public API: agents, tables, timers, tasks, web views, signals
and documented settings.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import faust
from faust.transport.utils import DefaultSchedulingStrategy

from pipeline.cancellations import CancellationView
from pipeline.catalog.store import ModelStore
from pipeline.config import Settings
from pipeline.errors import ConfigError, LlmqError
from pipeline.gateway import faust_compat
from pipeline.gateway.checkpoint import DecisionCheckpoint
from pipeline.gateway.completions import Completions
from pipeline.gateway.depths import DispatchDepths, Reading
from pipeline.gateway.health import GatewayHealth
from pipeline.gateway.intake import Intake
from pipeline.gateway.membership import broker_session_bounds, choose_session_ms, heartbeat_ms
from pipeline.gateway.outputs import Outputs
from pipeline.gateway.partitions import Ownership, partitioner
from pipeline.gateway.positions import (HoleReader, ReadPositions, RequestPartition, committed_of_partition,
                                        committed_or_start)
from pipeline.gateway.seen import SeenDecisions
from pipeline.gateway.stall_watch import EndOffsets, StallWatch
from pipeline.gateway.tenant_states import TenantStates
from pipeline.gateway.transactions import Redeliveries, Transactions
from pipeline.models import BANDS, Priority, now_ms
from pipeline.observability.health import Events
from pipeline.observability.metrics import GatewayMetrics
from pipeline.partitioning import tenant_partition
from pipeline.policy.admission import Admission, DegradePolicy, RateLimits
from pipeline.policy.fairness import FairnessQuotas
from pipeline.policy.priority import PriorityPolicy
from pipeline.policy.queues import CappedView, QueueModel
from pipeline.policy.shadow import Shadow
from pipeline.runtime import freeze_long_lived
from pipeline.serde.factory import codec_for
from pipeline.tenants.registry import TenantRegistry
from pipeline.topics import TopicSpec, ensure_topics, wait_visible

log = logging.getLogger(__name__)

#: How often idle tenant records are looked for (and deleted at the next checkpoint).
_SWEEP_S = 30.0


class BandFirst(DefaultSchedulingStrategy):
    """The records of one fetch, higher bands first (each band's partitions in turn, as Faust
    does): a flood in a lower band never stands in front of a higher band's records."""

    ranks: dict[str, int] = {}

    @classmethod
    def for_topics(cls, ranks: dict[str, int]) -> type["BandFirst"]:
        return type(cls.__name__, (cls,), {"ranks": dict(ranks)})

    def iterate(self, records):
        index = self.map_from_records(records)
        last = len(BANDS)
        for topic in sorted(index, key=lambda t: self.ranks.get(t, last)):
            yield from index[topic]


class Gateway:
    def __init__(self, settings: Settings, *, app_id: str | None = None, web_port: int | None = None,
                 metrics: GatewayMetrics | None = None, datadir: str | None = None):
        self.settings = settings
        g, t = settings.gateway, settings.topics
        if t.request_partitions != t.response_partitions:
            raise ConfigError("topics.response_partitions",
                              f"must equal topics.request_partitions ({t.request_partitions}): the gateway keeps a "
                              "tenant's state beside its requests and its responses, which needs them co-partitioned")
        self.codec = codec_for(settings.serde)
        self.metrics = metrics or GatewayMetrics()
        port = g.web_port if web_port is None else web_port
        app_id = app_id or g.app_id
        # Faust keeps its local state here and creates only the last level.
        datadir = Path(datadir or Path(".llmq") / f"gateway-{app_id}")
        datadir.parent.mkdir(parents=True, exist_ok=True)
        self.request_ranks = {t.request_topic(p): p.rank for p in BANDS}
        faust_compat.set_fetch_wait(g.fetch_max_wait_ms, g.fetch_min_bytes)
        scheme = faust_compat.broker_scheme()
        exactly_once = g.processing_guarantee == "exactly-once"
        if exactly_once and scheme != faust_compat.SCHEME:
            raise ConfigError("gateway.processing_guarantee", "exactly-once holds Faust's commits through the "
                              f"shim written for {faust_compat.WRITTEN_FOR}; installed: "
                              f"{faust_compat.installed_versions()}")
        faust_compat.set_read_committed(exactly_once)
        self.app = faust.App(
            app_id, broker=[f"{scheme}://{hp.strip()}" for hp in settings.kafka.bootstrap.split(",")],
            broker_credentials=_credentials(settings), store="memory://", autodiscover=False,
            processing_guarantee="at_least_once", topic_partitions=t.request_partitions,
            topic_replication_factor=t.replication_factor, table_standby_replicas=1,
            producer_linger=g.producer_linger_ms / 1000.0, producer_acks=-1, producer_partitioner=partitioner,
            consumer_auto_offset_reset="earliest", broker_commit_interval=1.0,
            broker_session_timeout=g.session_timeout_ms / 1000.0,
            broker_heartbeat_interval=heartbeat_ms(g.session_timeout_ms) / 1000.0,
            consumer_group_instance_id=g.instance_id or None,
            ConsumerScheduler=BandFirst.for_topics(self.request_ranks),
            # Exactly-once, a rebalance need not wait for every event to be acknowledged: the new
            # owner's producer fences this one's transactions and it redoes from the committed
            # offsets. And it must not: a superseded round's events are never acknowledged
            # (transactions.py), and Faust would wait for them for ever.
            stream_wait_empty=not exactly_once,
            web_enabled=bool(port), web_port=port or 6066, web_bind=g.web_host, datadir=str(datadir))

        raw = dict(key_type=bytes, value_type=bytes, value_serializer="raw")
        self.requests = {p: self.app.topic(t.request_topic(p), **raw) for p in BANDS}
        # Where the gateway learns that a dispatched request finished (see completions.py).
        self.finished_in = self.app.topic(t.responses, t.receipts, **raw)
        # Keys are raw bytes (the app's key_serializer), values JSON (its value_serializer).
        table = dict(partitions=t.request_partitions, key_type=bytes, use_partitioner=True)
        self.tenants_table = self.app.Table("tenants", default=None, **table)
        self.seen_table = self.app.Table("seen", default=None, **table)

        self.ownership = Ownership(t.request_partitions)
        self.positions = ReadPositions(committed_or_start(settings, app_id))
        # Written against the installed faust-streaming only, as the fetch-wait shim.
        self.recovery_watch = faust_compat.RecoveryWatch(self.app) if scheme == faust_compat.SCHEME else None
        self.holes = HoleReader(settings)
        self.tenants = TenantStates(self.tenants_table)
        self.seen = SeenDecisions(self.seen_table, self.ownership, g.dedupe_horizon_ms)
        caps = g.band_ints("queue_caps")
        self.queues = QueueModel([caps.get(p.value, 0) for p in BANDS], default_rate_per_s=g.default_drain_rate,
                                 target_queue_ms=g.target_queue_ms,
                                 commit_lag_ms=settings.worker.commit_interval_ms,
                                 partition_of=_dispatch_partition(t.dispatch_partitions),
                                 min_shares=[settings.worker.band_min_share.get(p.value, 0.0) for p in BANDS])
        # Who a tenant is (tier, highest band, models, signatures) and its own limits and caps:
        # read live from the registry topic; the config's per-tenant tables still win.
        self.registry = TenantRegistry(settings)
        # Which models the pools serve (pipeline/catalog/): a model none serves is refused here.
        self.models = ModelStore(settings)
        self.admission = self._admission(g, self.queues)
        shadowed = g.shadow_policy()
        self.shadow = None
        if shadowed is not None:
            shadow_caps = shadowed.band_ints("queue_caps")
            self.shadow = Shadow(self._admission(shadowed, CappedView(self.queues, [shadow_caps.get(p.value, 0)
                                                                                    for p in BANDS])))
            log.info("shadow policy on: %s judged beside the real policy, counted in "
                     "llmq_gateway_shadow_decisions_total, never enforced", ", ".join(sorted(g.shadow)))
        self.cancellations: CancellationView | None = None
        self._reload = True  # after a rebalance: memory is rebuilt from the recovered tables
        self._stopping = False
        self.outputs: Outputs | None = None
        self.transactions: Transactions | None = None
        self.redeliveries = Redeliveries()
        if exactly_once:
            self.transactions = Transactions(
                app_id, {**settings.kafka.aiokafka_config(), "client_id": f"{app_id}-eos"}, self._refused,
                hold_commits=lambda: faust_compat.commits_held(self.app.consumer),
                read_floor=committed_of_partition(settings, app_id, [*self.request_ranks, t.responses, t.receipts]))
        else:
            # An output not delivered within a minute stops the gateway (Outputs), and the restart
            # redoes from the last commit: after a whole-cluster restart librdkafka's idempotent
            # producer can deliver nothing more (docs/operations.md), and its default five
            # minutes was how long a gateway then admitted nothing.
            self.outputs = Outputs(settings.kafka.producer_config(**{
                "client.id": f"{app_id}-out", "linger.ms": g.producer_linger_ms, "message.timeout.ms": 60_000}),
                self._refused)
        self.checkpoint = DecisionCheckpoint(self.app.producer, self.tenants, self.seen, self.outputs,
                                             state_every_s=g.state_flush_ms / 1000.0,
                                             every_s=g.decision_flush_ms / 1000.0, transactions=self.transactions)
        common = dict(codec=self.codec, admission=self.admission, tenants=self.tenants, seen=self.seen,
                      checkpoint=self.checkpoint, metrics=self.metrics)
        self.intake = Intake(wire=settings.serde.wire_format, topics=t, cancelled=self._cancelled,
                             authorize=self.registry.authorize, shadow=self.shadow, **common)
        self.completions = Completions(partitions=t.request_partitions, receipts=t.receipts, **common)
        self.depths = DispatchDepths(settings, self._reading, interval_s=g.depth_refresh_ms / 1000.0)
        self.stall_watch: StallWatch | None = None
        if g.stall_s:
            read = {*self.request_ranks, t.responses, t.receipts}
            self.stall_watch = StallWatch(
                self.app, read, g.stall_s, None, Events(self.metrics.health_recoveries, self.metrics.health_stalls),
                give_up=lambda detail: self.health.give_up(detail))
            self.stall_watch.ends = EndOffsets(settings, self.stall_watch.ended, read_committed=exactly_once,
                                               interval_s=self.stall_watch.interval_s)
        self.health = GatewayHealth(self)
        self._wire()

    # -- the app's parts ------------------------------------------------------------------

    def _wire(self) -> None:
        app = self.app
        gateway = self

        for band, topic in self.requests.items():
            # One agent per band: each has its own stream, so a backlog in one band's stream
            # never stands in front of another band's requests.
            @app.agent(topic, name=f"admit-{band.value.lower()}")
            async def admit(stream):
                async for event in stream.noack().events():
                    msg = event.message
                    if gateway.stall_watch is not None:
                        gateway.stall_watch.consumed(msg.topic, msg.partition)
                    if not gateway.fresh(msg):
                        event.ack()
                        continue
                    tp = RequestPartition(msg.topic, msg.partition)
                    hole = gateway.positions.check(tp, msg.offset)
                    skipped = ()
                    if hole is not None:  # a stale record after a rebalance (positions.py)
                        skipped = await asyncio.get_running_loop().run_in_executor(
                            None, gateway.holes.read, tp, hole)
                    gateway._maybe_reload()
                    gateway.intake.handle(event, before=skipped)

        @app.agent(self.finished_in, name="completions")
        async def completions(stream):
            async for event in stream.noack().events():
                if gateway.stall_watch is not None:
                    gateway.stall_watch.consumed(event.message.topic, event.message.partition)
                if not gateway.fresh(event.message):
                    event.ack()
                    continue
                gateway._maybe_reload()
                gateway.completions.handle(event)

        @app.task
        async def start() -> None:
            if gateway.outputs is not None:
                gateway.outputs.start(asyncio.get_running_loop())
            gateway.depths.start()
            if gateway.stall_watch is not None:
                gateway.stall_watch.start(asyncio.get_running_loop())
            await gateway.checkpoint.run()

        app.timer(0.2, on_leader=False)(self._poll_cancellations)
        app.timer(_SWEEP_S, on_leader=False)(self._sweep)
        if self.recovery_watch is not None:
            app.timer(1.0, on_leader=False)(self.recovery_watch.check)
        if self.stall_watch is not None:
            app.timer(self.stall_watch.interval_s, on_leader=False)(self.stall_watch.check)

        async def health_tick() -> None:
            gateway.health.tick()

        app.timer(1.0, on_leader=False)(health_tick)

        async def assigned(sender, assigned, **kwargs):
            request_topics = set(gateway.request_ranks)
            gateway.ownership.assigned({tp.partition for tp in assigned if tp.topic in request_topics})
            gateway._reload = True
            mine = [RequestPartition(tp.topic, tp.partition) for tp in assigned if tp.topic in request_topics]
            # In the loop, not an executor: no record of the new generation may be handled before this.
            gateway.positions.assigned(mine)
            if gateway.transactions is not None:
                gateway.redeliveries.assigned()
                await gateway.transactions.assigned(gateway.ownership.active)

        app.on_partitions_assigned.connect(assigned)

        async def close_outputs(sender, **kwargs):
            gateway._stopping = True
            gateway.depths.stop()
            if gateway.stall_watch is not None:
                gateway.stall_watch.stop()
            gateway.registry.stop()
            gateway.models.stop()
            await gateway.checkpoint.round(final=True)
            if gateway.outputs is not None:
                gateway.outputs.close()
            if gateway.transactions is not None:
                await gateway.transactions.close()

        app.on_before_shutdown.connect(close_outputs)

        async def queue_view(view, request):
            return view.json(gateway.queue_snapshot())

        async def metrics_view(view, request):
            from prometheus_client import generate_latest

            return view.bytes(generate_latest(gateway.metrics.registry), content_type="text/plain")

        app.page("/v1/queue")(queue_view)
        app.page("/metrics")(metrics_view)
        async def healthz_view(view, request):
            return await gateway.health.healthz(view, request)

        async def readyz_view(view, request):
            return await gateway.health.readyz(view, request)

        app.page("/healthz")(healthz_view)
        app.page("/readyz")(readyz_view)

    def _admission(self, g, queues) -> Admission:
        """The admission policy of settings ``g`` (the real one, or the shadow's), over ``queues``."""
        default_limits, tenant_limits = g.rate_limits()
        return Admission(
            PriorityPolicy(tier_offsets=dict(g.tier_offsets), urgent_ms=g.urgent_ms,
                           urgent_eta_factor=g.urgent_eta_factor, high_load=g.high_load,
                           load_spared_share=g.load_spared_share),
            RateLimits(default_limits, tenant_limits, lookup=self._registered_limits),
            FairnessQuotas(g.band_ints("tenant_outstanding"), floor=Priority(g.demote_floor),
                           tenant_caps=dict(g.tenant_outstanding_overrides), lookup=self._registered_caps),
            queues,
            DegradePolicy(load=g.degrade_load, downgrade=dict(g.downgrade), simple_prompt_tokens=g.simple_prompt_tokens,
                          simple_max_tokens=g.simple_max_tokens),
            max_timeout_ms=g.max_timeout_ms, topics_prefix=self.settings.topics.prefix, early_expiry=g.early_expiry,
            max_delay_ms=g.rate_limit_max_delay_ms, reorder_ms=g.rate_limit_reorder_ms, models=self.models.catalog)

    def _registered_limits(self, tenant: str):
        record = self.registry.get(tenant)
        return None if record is None else record.limits

    def _registered_caps(self, tenant: str):
        record = self.registry.get(tenant)
        return None if record is None else record.outstanding

    def _maybe_reload(self) -> None:
        """The first event after a rebalance: the tables are recovered by now (Faust delivers no
        event before), and every request decided before it has been written and acknowledged
        (Faust waits for that before a rebalance goes on)."""
        if not self._reload:
            return
        self._reload = False
        self.tenants.forget()
        ids = self.seen.load(now_ms())
        if ids:
            charged = self.intake.charge_recorded(self.ownership.owns)
            log.info("remembering %d request ids from the tables (%d admissions charged again)", ids, charged)

    def fresh(self, msg) -> bool:
        """At-least-once every record is decided; exactly-once not one delivered again, nor one
        below its partition's floor, once that is known (transactions.py). An event decided before
        its floor was read again after a rebalance is filtered out of its round instead."""
        txns = self.transactions
        if txns is None:
            return True
        return (txns.fresh(msg.topic, msg.partition, msg.offset)
                and self.redeliveries.fresh(msg.topic, msg.partition, msg.offset))

    def _refused(self, what: str) -> None:
        """The broker refused an output after librdkafka's retries (or a transaction): stop, so
        that a restart redoes everything from the last commit, which is before that output's request."""
        if self._stopping:
            return
        self._stopping = True
        exc = LlmqError(f"gateway output not delivered ({what}); stopping: a restart admits again from the last commit")
        log.error("%s", exc)
        asyncio.ensure_future(self.app.crash(exc))

    def _reading(self, reading: Reading) -> None:
        """From the depth thread: handed to the event loop, where the queue model lives."""
        loop = self.app.loop
        if not loop.is_closed():
            loop.call_soon_threadsafe(self.queues.observe, reading.depths, reading.arrived, reading.drained,
                                      reading.at_ms, reading.partitions, reading.arrivals, reading.ends)

    def _cancelled(self, request_id: str) -> bool:
        return self.cancellations is not None and self.cancellations.reason(request_id) is not None

    async def _poll_cancellations(self) -> None:
        if self.cancellations is None:
            self.cancellations = CancellationView(self.settings)
        self.cancellations.poll()
        self.metrics.observe_queues(self.queues.snapshot())

    async def _sweep(self) -> None:
        now = now_ms()
        self.tenants.sweep(now)
        if self.shadow is not None:
            self.shadow.sweep(now)

    def queue_snapshot(self) -> dict:
        """What GET /v1/queue answers: per band depth, cap and ETA, the drain rate and the load."""
        return {"at_ms": now_ms(), **self.queues.snapshot()}

    # -- running --------------------------------------------------------------------------

    def internal_topics(self) -> list[TopicSpec]:
        """The changelog topics of the gateway's tables and Faust's assignor topic."""
        rf = self.settings.topics.replication_factor
        horizon_ms = max(2 * self.settings.gateway.dedupe_horizon_ms, 60_000)
        specs = [TopicSpec(f"{self.app.conf.id}-__assignor-__leader", 1, rf, {}, "gateway assignor")]
        for table in (self.tenants_table, self.seen_table):
            config = {"cleanup.policy": "compact"}
            if table is self.seen_table:  # old ids go with time, whoever wrote them
                config = {"cleanup.policy": "compact,delete", "retention.ms": str(horizon_ms)}
            specs.append(TopicSpec(table.changelog_topic.get_topic_name(), table.partitions, rf, config,
                                   "gateway state"))
        return specs

    def ensure_internal_topics(self, timeout: float = 30.0) -> None:
        """Create the internal topics before Faust starts, and wait until the broker lists them.

        Faust creates them itself too, but subscribes right after: a topic the metadata does
        not show yet is left out of the assignment, and the first table write then fails
        with PartitionsMismatch ("has 0 partitions").
        """
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(self.settings.kafka.admin_config())
        t = self.settings.topics
        listed = admin.list_topics(timeout=timeout).topics
        for name in [*t.request_topics, t.responses, t.receipts]:
            md = listed.get(name)
            if md is not None and md.error is None and len(md.partitions) != t.request_partitions:
                raise LlmqError(f"{name} has {len(md.partitions)} partitions, the gateway needs "
                                f"{t.request_partitions} (topics.request_partitions) on every request topic and the "
                                "response topic: a tenant's requests, responses and state must be co-partitioned")
        specs = self.internal_topics()
        report = ensure_topics(admin, specs, timeout)
        if report.mismatched:
            raise LlmqError("gateway state topics have other partition counts than their sources: "
                            + ", ".join(f"{t} ({have}, expected {want})" for t, want, have in report.mismatched))
        wait_visible(admin, [s.name for s in specs], timeout)

    def join_within_broker_bounds(self) -> None:
        """Ask for gateway.session_timeout_ms as far as the broker allows it (see membership.py):
        a session outside its bounds would make every join fail."""
        from confluent_kafka.admin import AdminClient

        asked = self.settings.gateway.session_timeout_ms
        session = choose_session_ms(asked, broker_session_bounds(AdminClient(self.settings.kafka.admin_config())))
        if session != asked:
            self.app.conf.broker_session_timeout = session / 1000.0
            self.app.conf.broker_heartbeat_interval = heartbeat_ms(session) / 1000.0

    def run(self, loglevel: str = "INFO") -> None:
        """Run until SIGTERM/SIGINT (then: write and deliver what is decided, commit, leave the
        group). Exits the process."""
        self.ensure_internal_topics()
        self.join_within_broker_bounds()
        # Before the first request: a tenant is never decided on without its record.
        self.registry.start(wait_s=30.0)
        self.models.start(wait_s=30.0)
        worker = _GatewayWorker(self.app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
        worker.health = self.health
        worker.execute_from_commandline()


class _GatewayWorker(faust.Worker):
    health: GatewayHealth | None = None

    async def on_startup_finished(self) -> None:
        await super().on_startup_finished()
        freeze_long_lived("gateway")  # tables are recovered by now
        if self.health is not None:
            self.health.started = True


def _credentials(settings: Settings):
    k = settings.kafka
    if k.security_protocol == "PLAINTEXT":
        return None
    conf = k.aiokafka_config()
    ssl_context = conf.get("ssl_context")
    if k.security_protocol.startswith("SASL_"):
        return faust.SASLCredentials(username=k.sasl_username, password=k.password(), ssl_context=ssl_context,
                                     mechanism=k.sasl_mechanism)
    return faust.SSLCredentials(ssl_context)


def _dispatch_partition(partitions: int):
    """The dispatch partition of a tenant's requests (keyed by tenant, as every llmq topic)."""
    cache: dict[str, int] = {}

    def partition_of(tenant: str) -> int:
        p = cache.get(tenant)
        if p is None:
            if len(cache) >= 65536:
                cache.clear()
            p = cache[tenant] = tenant_partition(tenant.encode(), partitions)
        return p

    return partition_of
