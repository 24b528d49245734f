"""`llmq gateway`: a Faust app that admits requests from the five request topics.

For every request: decode (undecodable → dead-letter topic), drop a re-submitted id, then the
pure admission decision (:mod:`pipeline.policy.admission`); admitted requests go to
``<prefix>.dispatch.<band>`` carrying their admission time, effective priority and (if
degraded) the model asked for; rejections, expirations and cancellations go straight to the
response topic with their reason and ``retry_after_ms``.

State lives in Faust tables backed by changelog topics, so it survives a restart:

* ``rate-<limit>``: one tumbling windowed table per configured rate limit, [requests, tokens]
  per tenant (or tenant × model) and window, windows taken from the gateway's clock;
* ``admitted`` / ``finished``: per tenant and band, requests dispatched and requests whose
  terminal response came back (read back from the response topic); the
  difference is what the fairness quotas and queue depths are computed from;
* ``seen``: request ids answered recently with the message they came in (one record per
  partition and period, below), so a re-submitted id is answered once while a redelivered
  message (after a crash) is processed again.

The tables use Faust's memory store (the only one supported: Faust's rocksdb store reads a key
from the current event's partition only) and are read and written directly (their store, and
changelog records encoded as Faust encodes them). Their changes are written to the changelogs
every ``state_flush_ms`` (each key once, with the partition and clock of its last change), and
the offsets of the requests behind them are committed only after that write; Faust still
recovers the tables from the changelogs at start.

Intake and delivery: the consumer hands each fetch's records to the gateway in batches, band
by band, CRITICAL first (:mod:`pipeline.gateway.intake`; faust's per-event streams cost more
than the admission itself). One batch is handled at a time, so nothing commits past work in
flight (faust#606 is about concurrent agents). A batch's outputs, changelog records included,
go through librdkafka, and its offsets are acknowledged only when the broker has acknowledged
every one of them (:mod:`pipeline.gateway.deliveries`), while the next batch is already being
handled.
"""

from __future__ import annotations

import asyncio
import logging
from json import dumps as _json_dumps
import time
from collections import deque
from pathlib import Path

import faust
from confluent_kafka import Producer
from mode.utils.times import want_seconds

from pipeline.cancellations import CancellationView
from pipeline.config import Settings
from pipeline.dlq import dead_letter_headers
from pipeline.errors import DecodeError, EncodeError, LlmqError
from pipeline.gateway import faust_fixes
from pipeline.gateway.deliveries import Deliveries, Outputs
from pipeline.gateway.intake import Acks, BatchIntake
from pipeline.models import Priority, Response, Status
from pipeline.observability.metrics import GatewayMetrics, reason_code
from pipeline.policy.admission import Action, Admission, DegradePolicy
from pipeline.policy.fairness import FairnessQuotas, outstanding_key
from pipeline.policy.queues import QueueModel
from pipeline.policy.ratelimit import RateLimiter
from pipeline.runtime import freeze_long_lived
from pipeline.serde.factory import codec_for
from pipeline.topics import TopicSpec, ensure_topics

log = logging.getLogger(__name__)

_SEP = "\x1f"
_BAND_BY_NAME = {p.value: p for p in Priority}
_DEPTH_KEY_PREFIX = {p: f"{p.value}{_SEP}p" for p in Priority}  # + the request's partition
_STATUS_LABEL = {s: s.value.lower() for s in Status}
# Read per request: an enum member from its class, and an enum's ``value`` property, cost a
# lookup every time (``_value_`` is the member's plain attribute).
_DISPATCH = Action.DISPATCH


class _Batch:
    """Table reads and writes of one period (see ``Gateway._end_period``); writes are kept
    until its end and made once per key.

    Every table write is a changelog message; 200 requests from 50 tenants touch ~100
    counters, so writing each once at the end (to the changelog partition of the last record
    that changed it, with the clock of its decision) saves most of them. Reads see the
    period's own writes first, and a key is read from its table once per period: nothing else
    writes these tables (handling a batch never awaits, and the write happens between batches).
    """

    def __init__(self, gateway: "Gateway"):
        self.gateway = gateway
        self.partition = 0  # set by the gateway: the partition of the record being decided
        self.views: list[_View] = []

    def flush(self) -> None:
        g = self.gateway
        clock = g._clock_s
        for view in self.views:
            view.flush()
        g._clock_s = clock


class _View:
    """One table as one batch sees it: ``values`` read once (or written) this batch, ``dirty``
    the writes not made yet, each with the partition and clock of the decision that made it.
    ``who`` maps a key to the table's own key (a windowed table's key leaves out the window,
    which is the one holding the gateway's clock)."""

    __slots__ = ("direct", "batch", "values", "dirty", "who")

    def __init__(self, direct: "_Direct", batch: _Batch, who=None):
        self.direct, self.batch, self.who = direct, batch, who
        self.values: dict = {}
        self.dirty: dict = {}
        batch.views.append(self)

    def get(self, key, default=None):
        try:
            value = self.values[key]
        except KeyError:
            who = self.who
            value = self.values[key] = self.direct.get(key if who is None else who(key))
        return default if value is None else value

    def __getitem__(self, key):
        return self.get(key)

    def __setitem__(self, key, value) -> None:
        self.values[key] = value
        batch = self.batch
        self.dirty[key] = (value, batch.partition, batch.gateway._clock_s)

    def add(self, key, n: int = 1) -> None:
        values = self.values  # self[key] = self.get(key) + n, inline: two admissions' worth a request
        try:
            value = values[key]
        except KeyError:
            value = self.get(key)
        value = values[key] = (value or 0) + n
        batch = self.batch
        self.dirty[key] = (value, batch.partition, batch.gateway._clock_s)

    def flush(self) -> None:
        g, direct, who = self.batch.gateway, self.direct, self.who
        for key, (value, partition, clock_s) in self.dirty.items():
            g._clock_s = clock_s
            direct.set(key if who is None else who(key), value, partition)
        self.dirty.clear()
        self.values.clear()


class _Direct:
    """A table read and written directly: its (memory) store, and changelog records, encoded as
    Faust encodes them, sent with the batch's other outputs; a windowed table's key is the
    window holding the gateway's clock, registered for expiry as Faust does it. Faust's own
    path (a sensor call per read and write, the partition looked up from the current event,
    the key serialised every time) was most of the gateway's table time.

    The counters' values (an int, or [requests, tokens]) are encoded without Faust's serializer
    stack when that gives Faust's bytes (checked once, here); keys, windowed ones included,
    are encoded once and remembered.
    """

    # Windowed keys change with every window: a larger cache only holds dead windows (at 100,000
    # tenants, 200,000 remembered keys were ~38 MB of the gateway's RSS).
    _MAX_REMEMBERED_KEYS = 50_000

    def __init__(self, table, gateway: "Gateway"):
        self.gateway = gateway
        self.table = t = getattr(table, "table", table)
        self.window = t.window
        # The memory store keeps a plain dict: use it without the store's mapping layers.
        data = getattr(t.data, "data", None)
        self.data = data if type(data) is dict else t.data
        self.default = t.default
        topic = t.changelog_topic
        self.topic_name = topic.get_topic_name()
        self._encode_key = lambda k: topic.prepare_key(k, t.key_serializer, None, {})[0]
        self._faust_value = lambda v: topic.prepare_value(v, t.value_serializer, None, {})[0]
        self._fast_values = all(_fast_counter_value(v) == self._faust_value(v)
                                for v in (0, 7, -3, 10**12, [1, 10], [0, 0], [5, 123456789]))
        # The remembered ids ([(id, source), ...], a record per period and partition): the
        # standard library's JSON at half the cost of Faust's serializer stack, same bytes.
        self._fast_lists = all(_compact_json(v) == self._faust_value(v) for v in (
            [], [("0b0c8f6e-8d0e-4c51-9a3c-2f1d3e4a5b6c", "llm.requests.normal:3:17")],
            [("id\u00e9\u2028\"\\\x01", "t:0:0"), ("x", "y")]))
        self._key_bytes: dict = {}
        self._window_clock = None
        self._window_now = None

    def _full_key(self, key):
        window = self.window
        if window is None:
            return key
        clock = self.gateway._clock_s
        if clock != self._window_clock:
            self._window_clock, self._window_now = clock, window.current(clock)
        return key, self._window_now

    def get(self, key):
        try:
            return self.data[self._full_key(key)]
        except KeyError:
            return self.default() if self.default is not None else None

    def set(self, key, value, partition: int) -> None:
        full = self._full_key(key)
        self.data[full] = value
        encoded = self._key_bytes.get(full)
        if encoded is None:
            if len(self._key_bytes) > self._MAX_REMEMBERED_KEYS:
                self._key_bytes.clear()
            encoded = self._key_bytes[full] = self._encode_key(full)
        value_bytes = _fast_counter_value(value) if self._fast_values else None
        if value_bytes is None and self._fast_lists and type(value) is list:
            value_bytes = _compact_json(value)
        if value_bytes is None:
            value_bytes = self._faust_value(value)
        self.gateway._outputs.produce(self.topic_name, value_bytes, encoded, partition=partition, bulk=True)
        if self.window is not None and self.window.expires is not None:
            self.table._maybe_set_key_ttl(full, partition)


def _fast_counter_value(value) -> bytes | None:
    """JSON of an int or of a pair of ints (what the counters hold), else None."""
    if type(value) is int:
        return b"%d" % value
    if type(value) is list and len(value) == 2 and type(value[0]) is int and type(value[1]) is int:
        return b"[%d,%d]" % (value[0], value[1])
    return None


def _compact_json(value) -> bytes:
    return _json_dumps(value, separators=(",", ":")).encode()


class _WindowedCounts:
    """The rate limiter's counters, kept in one Faust windowed table per limit.

    The limiter's keys are ``(limit, who, window start)``; the window comes from the table's
    clock (``relative_to``, set by the gateway before each decision), which is the same
    epoch-aligned tumbling window the limiter computed. Keyed by the full key within a batch,
    so a window boundary inside a batch is exact.
    """

    def __init__(self, tables: dict, batch: _Batch):
        self.views = {name: _View(table, batch, who=_who) for name, table in tables.items()}

    def get(self, key, default=None):
        return self.views[key[0]].get(key, default)

    def __getitem__(self, key):
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key, value):
        self.views[key[0]][key] = value

    def for_limit(self, name: str) -> "_View":
        """The counts of one limit (the rate limiter looks them up once)."""
        return self.views[name]


def _who(key: tuple) -> str:
    return key[1]


class _Outstanding:
    """Outstanding = admitted − finished, per ``tenant<US>band``; writes go to ``admitted``
    (the gateway admits from request records), completions to ``finished`` (response records):
    each table is written from one source, so their changelogs follow their own topic."""

    def __init__(self, admitted: _View, finished: _View):
        self.admitted, self.finished = admitted, finished

    def get(self, key, default=0):
        n = (self.admitted.get(key) or 0) - (self.finished.get(key) or 0)
        return n if n > 0 else 0

    __getitem__ = get

    def __setitem__(self, key, value):
        admitted = self.admitted.get(key) or 0
        current = max(0, admitted - (self.finished.get(key) or 0))
        if value > current:
            self.admitted[key] = admitted + (value - current)

    def add(self, key, n: int = 1) -> None:
        """One more admitted (what ``self[key] = self[key] + 1`` does, in one read)."""
        self.admitted.add(key, n)

    def __delitem__(self, key):
        pass  # a completion: counted in `finished` by the completions handler


class Gateway:
    def __init__(self, settings: Settings, *, app_id: str | None = None, web_port: int | None = None,
                 metrics: GatewayMetrics | None = None, datadir: str | None = None):
        faust_fixes.apply()
        self.settings = settings
        g = self.cfg = settings.gateway
        t = settings.topics
        faust_fixes.FETCH_MAX_WAIT_MS = g.fetch_max_wait_ms
        faust_fixes.BUSY_FETCH_WAIT_MS = g.busy_fetch_wait_ms
        faust_fixes.FETCH_SESSIONS = g.fetch_sessions
        faust_fixes.PROMPT_FETCH_TOPICS = frozenset(t.request_topic(Priority[b]) for b in g.prompt_fetch_bands)
        self.codec = codec_for(settings.serde)
        self._wire = settings.serde.wire_format
        self.metrics = metrics or GatewayMetrics()
        port = g.web_port if web_port is None else web_port
        app_id = app_id or g.app_id
        broker = ";".join(f"kafka+llmq://{hp.strip()}" for hp in settings.kafka.bootstrap.split(","))
        credentials = _credentials(settings)
        # Faust keeps its local state here and creates only the last level.
        datadir = Path(datadir or Path(".llmq") / f"gateway-{app_id}")
        datadir.parent.mkdir(parents=True, exist_ok=True)
        self.app = faust.App(
            app_id, broker=broker, store=g.store, autodiscover=False, processing_guarantee="at_least_once",
            topic_partitions=t.request_partitions, topic_replication_factor=t.replication_factor,
            table_standby_replicas=0, producer_linger=g.producer_linger_ms / 1000.0, producer_acks=-1,
            consumer_auto_offset_reset="earliest", broker_commit_interval=0.5,
            broker_session_timeout=g.session_timeout_ms / 1000.0,
            broker_heartbeat_interval=g.session_timeout_ms / 5000.0,
            consumer_group_instance_id=g.instance_id or None,
            web_enabled=bool(port), web_port=port or 6066, web_bind=g.web_host,
            datadir=str(datadir), broker_credentials=credentials)
        self._clock_s = time.time()
        # What the gateway publishes (dispatch, responses, dead letters) goes through
        # librdkafka: a produce costs microseconds there, against a good part of a
        # millisecond through aiokafka; each batch waits for its deliveries before its
        # offsets are acknowledged. Faust's own producer still writes the tables' changelogs.
        self.out = Producer(settings.kafka.producer_config(**{
            "client.id": f"{app_id}-out", "linger.ms": g.producer_linger_ms}))
        # BACKGROUND dispatches and the tables' changelogs wait longer to be sent together:
        # librdkafka sends a produce request per partition, and a flood of bulk work over 12
        # dispatch partitions at 5 ms was a request per message for the broker, whose CPU the
        # other bands share. (LOW is where NORMAL requests over their tenant's quota are
        # demoted to: they keep the short linger.)
        self.bulk_out = Producer(settings.kafka.producer_config(**{
            "client.id": f"{app_id}-bulk", "linger.ms": g.bulk_linger_ms})) if g.bulk_linger_ms else None
        self._deliveries = Deliveries(self.out, bulk=self.bulk_out, on_failure=self._outputs_failed)
        self._stopping_on_failed_outputs = False
        self._bulk_from = Priority.BACKGROUND.rank
        self._outputs: Outputs | None = None

        # -- topics --
        raw = dict(key_type=bytes, value_type=bytes, value_serializer="raw")
        # One topic per band, served CRITICAL first within every fetch (see intake), so a
        # BACKGROUND flood waits in its own topic instead of in front of CRITICAL requests.
        self.requests = {p: self.app.topic(t.request_topic(p), **raw) for p in Priority}
        self.responses_in = self.app.topic(t.responses, **raw)
        self.responses_topic = t.responses
        self.dlq_topic = t.dlq
        self.dispatch_topics = {p: t.dispatch_topic(p) for p in Priority}

        # -- tables (changelog-backed) --
        default_limits, tenant_limits = g.window_limits()
        windows = {}
        for lim in [*default_limits, *(x for lims in tenant_limits.values() for x in lims)]:
            if windows.setdefault(lim.name, lim.window_ms) != lim.window_ms:
                raise ValueError(f"rate limit {lim.name!r} has different windows for different tenants")
            if lim.window_ms % 1000:
                raise ValueError(f"rate limit {lim.name!r}: the gateway's windows are whole seconds")
        self.rate_tables = {
            name: self.app.Table(f"rate-{name}", default=lambda: None, partitions=t.request_partitions)
            .tumbling(ms / 1000.0, expires=2 * ms / 1000.0).relative_to(lambda event=None: self._clock_s)
            for name, ms in windows.items()}
        self.admitted_t = self.app.Table("admitted", default=int, partitions=t.request_partitions)
        self.finished_t = self.app.Table("finished", default=int, partitions=t.response_partitions)
        # Request ids admitted or answered, one changelog record per batch and partition:
        # key = first offset of the batch there, value = [[request id, source], ...].
        horizon_s = max(2, g.dedupe_horizon_ms // 2000)
        self.seen_log = self.app.Table("seen", default=lambda: None, partitions=t.request_partitions) \
            .tumbling(float(horizon_s), expires=2.0 * horizon_s).relative_to(lambda event=None: self._clock_s)
        self._seen: dict[str, tuple[str, float]] = {}  # id → (source, clock_s)
        # (clock_s, id) in the order remembered, to forget them in that order: an OrderedDict
        # costs three times a dict to add to, and it is added to for every request.
        self._seen_order: deque[tuple[float, str]] = deque()
        self._seen_horizon_s = 2.0 * horizon_s

        for table in self.app.tables.values():
            self._changelog_through_outputs(table)

        def access(table):  # the memory store is the only one (see GatewaySettings.store)
            return _Direct(table, self)

        rate_access = {name: access(table) for name, table in self.rate_tables.items()}
        admitted, finished, self._seen_access = access(self.admitted_t), access(self.finished_t), access(self.seen_log)
        # One view of the tables for admissions and completions alike: the changes of a period
        # (see _end_period) are the tables' state until they are written.
        self._tables = _Batch(self)
        self._admitted = _View(admitted, self._tables)
        self._finished = _View(finished, self._tables)
        self._flush_s = g.state_flush_ms / 1000.0
        self._period: Outputs | None = None  # the outputs since the tables were last written
        self._period_acks: list[Acks] = []  # the batches waiting for that write
        self._period_seen: dict[int, list] = {}  # partition → [first record, [(id, source), ...]]
        self._period_started = 0.0
        self._flush_timer: asyncio.TimerHandle | None = None
        caps = g.band_ints("queue_caps")
        self.queues = QueueModel([caps.get(p.value, 0) for p in Priority], default_rate_per_s=g.default_drain_rate)
        self.admission = Admission(
            g.priority_policy(),
            RateLimiter(default_limits, tenant_limits, counts=_WindowedCounts(rate_access, self._tables)),
            FairnessQuotas(g.band_ints("tenant_outstanding"), floor=Priority(g.demote_floor),
                           tenant_caps=dict(g.tenant_outstanding_overrides),
                           counts=_Outstanding(self._admitted, self._finished)),
            self.queues,
            DegradePolicy(load=g.degrade_load, downgrade=dict(g.downgrade), simple_prompt_tokens=g.simple_prompt_tokens,
                          simple_max_tokens=g.simple_max_tokens),
            max_timeout_ms=g.max_timeout_ms)
        self.cancellations: CancellationView | None = None
        self._dispatch_by_rank = tuple(self.dispatch_topics[p] for p in Priority)
        self._band_names = tuple(p.value for p in Priority)
        self._depth_loaded = False
        # A batch is handled without yielding to the event loop: kept short.
        self.batch_size = g.batch_size

        for topic in (*self.requests.values(), self.responses_in):
            self.app.topics.add(topic)  # subscribed by faust; the intake takes their records
        handlers = {topic.get_topic_name(): self._admit_events for topic in self.requests.values()}
        handlers[self.responses_in.get_topic_name()] = self._complete_events
        self.app.llmq_intake = BatchIntake(handlers, self.batch_size)  # read by the consumer
        self.app.timer(0.2, on_leader=False)(self._poll_cancellations)
        gateway = self

        # Plain functions: Faust makes them methods of a View, so they get (view, request).
        async def queue_view(view, request):
            return view.json(gateway.queue_snapshot())

        async def metrics_view(view, request):
            from prometheus_client import generate_latest

            return view.bytes(generate_latest(gateway.metrics.registry), content_type="text/plain")

        async def close_outputs(app, **kwargs):
            gateway._end_period()
            gateway._deliveries.close()

        self.app.on_before_shutdown.connect(close_outputs)
        self.app.page("/v1/queue")(queue_view)
        self.app.page("/metrics")(metrics_view)

    # -- batches ---------------------------------------------------------------------------

    def _admit_events(self, records: list, acks: Acks) -> None:
        if self._deliveries.failed:
            raise self._outputs_failed()
        if not self._depth_loaded:
            self._load_state()
        tables = self._tables
        self._begin_batch()
        seen_new = self._period_seen
        for msg in records:
            tables.partition = msg.partition
            try:
                self._admit_one(msg, seen_new)
            except Exception as exc:  # noqa: BLE001 (a bug must neither stop the gateway nor lose the request)
                log.exception("admitting %s[%d]@%d failed", msg.topic, msg.partition, msg.offset)
                self._dead_letter(msg, "gateway_error", f"{type(exc).__name__}: {exc}")
        self._forget_old_ids()
        self._end_batch(acks)

    def _outputs_failed(self) -> LlmqError:
        """The broker refused an output after librdkafka's retries: stop, so that a restart
        redoes everything from the last commit, which is before that output's batch."""
        exc = LlmqError(f"gateway outputs not delivered: {self._deliveries.failed[:3]}")
        if not self._stopping_on_failed_outputs:
            self._stopping_on_failed_outputs = True
            log.error("%s; stopping: a restart admits again from the last commit", exc)
            asyncio.ensure_future(self.app.crash(exc))
        return exc

    def _complete_events(self, records: list, acks: Acks) -> None:
        now = _now_ms()
        self._clock_s = now / 1000.0
        tables = self._tables
        self._begin_batch()
        for msg in records:
            tables.partition = msg.partition
            try:
                self._complete_one(msg, now)
            except Exception:  # noqa: BLE001 (a response the gateway cannot count is still the client's)
                log.exception("counting the completion %s[%d]@%d failed", msg.topic, msg.partition, msg.offset)
        self._end_batch(acks)

    # -- periods: the tables' changes written together -------------------------------------

    def _begin_batch(self) -> None:
        if self._period is None:
            self._period = self._deliveries.batch()
            self._period_started = time.monotonic()
            if self._flush_s > 0:
                self._flush_timer = asyncio.get_running_loop().call_later(self._flush_s, self._flush_on_time)
        self._outputs = self._period

    def _end_batch(self, acks: Acks) -> None:
        self._period_acks.append(acks)
        if time.monotonic() - self._period_started >= self._flush_s:
            self._end_period()

    def _flush_on_time(self) -> None:
        self._flush_timer = None
        try:
            self._end_period()
        except Exception as exc:  # noqa: BLE001 (the batches stay unacknowledged: stop, a restart redoes them)
            log.exception("writing the gateway's tables failed")
            asyncio.ensure_future(self.app.crash(exc))

    def _end_period(self) -> None:
        """Write the tables' changes since the last write (each key once) and acknowledge the
        period's batches when the broker has every output of them, the changes included (from
        the delivery thread; meanwhile the next batches go ahead). Until then faust commits
        none of their offsets, and before a rebalance or a shutdown it waits for them."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        outputs = self._period
        if outputs is None:
            return
        self._outputs = outputs
        self._tables.flush()
        for first, entries in self._period_seen.values():
            self._seen_access.set(f"{first.partition}:{first.offset}", entries, first.partition)
        self._period_seen = {}
        acks, self._period_acks = self._period_acks, []
        self._period = None
        outputs.seal(lambda: _ack_all(acks))

    def _changelog_through_outputs(self, table) -> None:
        """Send ``table``'s changelog records with the batch's other outputs, through librdkafka.

        Through Faust's own producer (aiokafka) a changelog record costs a good part of a
        millisecond of the event loop, and its buffer of 100 fills and stalls the intake; here
        it costs microseconds, and the batch's offsets wait for it like for any other output,
        so a committed offset is never ahead of the table state it produced.
        """
        original = table.send_changelog
        topic = table.changelog_topic
        name = topic.get_topic_name()

        def send_changelog(partition, key, value, key_serializer=None, value_serializer=None):
            outputs = self._outputs
            if outputs is None or outputs.sealed or partition is None:
                return original(partition, key, value, key_serializer, value_serializer)
            k, headers = topic.prepare_key(key, key_serializer or table.key_serializer, None, {})
            v, headers = topic.prepare_value(value, value_serializer or table.value_serializer, None, headers)
            outputs.produce(name, v, k, headers or None, partition=partition, bulk=True)
            return _Sent(partition)

        table.send_changelog = send_changelog

    # -- one request ----------------------------------------------------------------------

    def _produce(self, topic: str, value: bytes, key: bytes | None, headers=None) -> None:
        self._outputs.produce(topic, value, key, headers)

    def _admit_one(self, msg, seen_new: dict) -> None:
        now = _now_ms()
        self._clock_s = now / 1000.0
        m = self.metrics
        try:
            req = self.codec.decode_request(msg.value)
        except DecodeError as exc:
            self._dead_letter(msg, exc.reason, str(exc))
            return

        source = f"{msg.topic}:{msg.partition}:{msg.offset}"
        seen = self._seen.get(req.request_id)
        if seen is not None and seen[0] != source:
            # The same id submitted again: it was (or is being) answered once already.
            m.outcome(req.priority.value, "duplicate")
            return
        self._remember(req.request_id, source, msg, seen_new)

        cancelled = self.cancellations is not None and self.cancellations.reason(req.request_id) is not None
        decision = self.admission.decide(req, now, cancelled=cancelled)
        band = decision.band or req.priority
        if decision.action is _DISPATCH:
            self._admitted.add(_DEPTH_KEY_PREFIX[band] + str(msg.partition))
            req.admitted_at = now
            req.effective_priority = band
            if decision.degraded_from is not None:
                req.model, req.degraded_from = decision.model, decision.degraded_from
                m.degraded.labels(req.priority.value).inc()
            if band is not req.priority:
                m.reprioritised.labels(req.priority.value, band.value).inc()
            m.outcome(req.priority._value_, "admitted")
            topic = self.dispatch_topics[band]
            self._outputs.produce(topic, self.codec.encode_request(req, self._wire, topic), req.tenant_id.encode(),
                                  bulk=band.rank >= self._bulk_from)
            if req.notify_queued:
                eta = decision.eta_ms
                self._respond(Response.for_request(
                    req, Status.QUEUED, admitted_at=now, served_priority=band, queue_position=decision.position,
                    eta_ms=None if eta is None or eta == float("inf") else int(eta), model=req.model,
                    degraded=req.degraded_from is not None))
            return

        status = {Action.REJECT: Status.REJECTED, Action.EXPIRE: Status.EXPIRED,
                  Action.CANCEL: Status.CANCELLED}[decision.action]
        outcome = {Status.REJECTED: "rejected", Status.EXPIRED: "expired", Status.CANCELLED: "cancelled"}[status]
        m.outcome(req.priority.value, outcome)
        if status is Status.REJECTED:
            m.rejections.labels(req.priority.value, reason_code(decision.reason)).inc()
        self._respond(Response.for_request(req, status, reason=decision.reason,
                                           retry_after_ms=decision.retry_after_ms, served_priority=decision.band))

    def _dead_letter(self, msg, reason: str, detail: str) -> None:
        self.metrics.outcome("UNKNOWN", "dead_lettered")
        self.metrics.dead_letters.labels(reason).inc()
        headers = dead_letter_headers(msg.topic, msg.partition, msg.offset, reason, detail, "gateway",
                                      list(msg.headers or ()))
        log.warning("dead-lettering %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, detail)
        self._produce(self.dlq_topic, msg.value, msg.key, headers)

    def _remember(self, request_id: str, source: str, msg, seen_new: dict) -> None:
        seen = self._seen
        if request_id in seen:
            return  # redelivered after a crash: already logged
        clock = self._clock_s
        seen[request_id] = (source, clock)
        self._seen_order.append((clock, request_id))
        entry = seen_new.get(msg.partition)
        if entry is None:
            entry = seen_new[msg.partition] = [msg, []]
        entry[1].append((request_id, source))

    def _forget_old_ids(self) -> None:
        """Forget the ids remembered before the horizon (once a batch)."""
        seen, order = self._seen, self._seen_order
        horizon = self._clock_s - self._seen_horizon_s
        while order and order[0][0] < horizon:
            clock, request_id = order.popleft()
            if seen.get(request_id, (None, None))[1] == clock:
                del seen[request_id]

    def _respond(self, response: Response) -> None:
        try:
            value = self.codec.encode_response(response, self._wire, self.responses_topic)
        except EncodeError as exc:
            # A rejection echoes nothing big, but a reason could still be long: keep it short.
            response.reason = f"{(response.reason or '')[:200]} ({exc})"[:500]
            value = self.codec.encode_response(response, self._wire, self.responses_topic)
        self._produce(self.responses_topic, value, response.tenant_id.encode())

    # -- completions ----------------------------------------------------------------------

    def _complete_one(self, msg, now: int) -> None:
        try:
            resp = self.codec.decode_response(msg.value)
        except DecodeError:
            return  # the response topic's consumers dead-letter nothing: not ours to judge
        if not resp.status.is_terminal or resp.admitted_at is None or resp.served_priority is None:
            return  # progress events, and answers to requests the gateway never dispatched
        band = resp.served_priority
        self._finished.add(outstanding_key(resp.tenant_id, band))
        self._finished.add(_DEPTH_KEY_PREFIX[band] + str(msg.partition))
        self.queues.finished(band.rank, now)
        self.metrics.finished.labels(band._value_, _STATUS_LABEL[resp.status]).inc()

    def _load_state(self) -> None:
        """After recovery: band depths (admitted minus finished) and the remembered ids."""
        self._depth_loaded = True
        admitted = [0] * len(Priority)
        finished = [0] * len(Priority)
        for table, into in ((self.admitted_t, admitted), (self.finished_t, finished)):
            for key, value in list(table.items()):
                band, _, rest = str(key).partition(_SEP)
                if band in _BAND_BY_NAME and rest.startswith("p"):
                    into[_BAND_BY_NAME[band].rank] += int(value or 0)
        # In place: the admission lane holds the list.
        self.queues.depth[:] = [max(0, a - f) for a, f in zip(admitted, finished)]
        if any(self.queues.depth):
            log.info("queue depths after recovery: %s",
                     ", ".join(f"{p.value} {self.queues.depth[p.rank]}" for p in Priority))
        restored = []
        for (_key, (start, _end)), entries in list(self.seen_log.table.data.items()):
            restored += [(start, rid, source) for rid, source in entries or ()]
        for start, rid, source in sorted(restored):
            if rid not in self._seen:
                self._seen[rid] = (source, start)
                self._seen_order.append((start, rid))
        if restored:
            log.info("remembering %d request ids from before the restart", len(self._seen))

    # -- timers and views -----------------------------------------------------------------

    async def _poll_cancellations(self) -> None:
        if self.cancellations is None:
            self.cancellations = CancellationView(self.settings)
        self.cancellations.poll()
        now = _now_ms()
        snap = self.queues.snapshot(now)
        m = self.metrics
        for p in Priority:
            m.depth.labels(p.value).set(snap["bands"][p.value]["depth"])
        m.drain.labels().set(snap["drain_rate_per_s"])
        m.load.labels().set(snap["load"])

    def queue_snapshot(self) -> dict:
        """What GET /v1/queue answers: per band depth, cap and ETA, the drain rate and the load."""
        now = _now_ms()
        return {"at_ms": now, **self.queues.snapshot(now)}

    # -- running --------------------------------------------------------------------------

    def internal_topics(self) -> list[TopicSpec]:
        """The changelog topics of the gateway's tables and Faust's assignor topic."""
        rf = self.settings.topics.replication_factor
        specs = [TopicSpec(f"{self.app.conf.id}-__assignor-__leader", 1, rf, {}, "gateway assignor")]
        for table in self.app.tables.values():
            # As Faust would create them: compacted; windowed tables also deleted after expiry.
            config = {"cleanup.policy": "compact"}
            if table.window is not None:
                config = {"cleanup.policy": "compact,delete",
                          "retention.ms": str(int(want_seconds(table.window.expires) * 1000))}
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
        specs = self.internal_topics()
        report = ensure_topics(admin, specs, timeout)
        if report.mismatched:
            raise LlmqError("gateway state topics have other partition counts than their sources: "
                            + ", ".join(f"{t} ({have}, expected {want})" for t, want, have in report.mismatched))
        deadline = time.monotonic() + timeout
        names = {s.name for s in specs}
        while True:
            listed = admin.list_topics(timeout=timeout).topics
            if all(n in listed and listed[n].error is None and listed[n].partitions for n in names):
                return
            if time.monotonic() > deadline:
                raise LlmqError(f"gateway state topics not visible after {timeout:.0f} s: "
                                + ", ".join(sorted(n for n in names if n not in listed)))
            time.sleep(0.2)

    def run(self, loglevel: str = "INFO") -> None:
        """Run until SIGTERM/SIGINT (then: finish the batch, commit, leave the group). Exits the process."""
        self.ensure_internal_topics()
        worker = _GatewayWorker(self.app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
        worker.execute_from_commandline()


class _GatewayWorker(faust.Worker):
    async def on_startup_finished(self) -> None:
        await super().on_startup_finished()
        freeze_long_lived("gateway")  # tables are recovered by now


class _Sent:
    """What Faust's table code reads back from ``send_changelog``: the partition written to."""

    __slots__ = ("message", "partition")

    def __init__(self, partition: int):
        self.message = self
        self.partition = partition


def _ack_all(acks: list[Acks]) -> None:
    for a in acks:
        a.ack()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


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
