"""Adjustments to faust-streaming 0.15.3, applied once before the gateway app starts.

1. **Seek before resume after table recovery.** ``Recovery.on_recovery_completed`` resumes the
   source partitions and only then seeks them to their committed offsets, while the fetcher
   already runs: events fetched in between are delivered, then delivered again after the seek,
   and with faust's commit bookkeeping an event can even be committed past unprocessed (found
   with a reproduction against a real broker; faust#216 fixed only the table-less path). The
   wrapper defers the resume until the seek is done.
2. **A shorter fetch wait.** faust hard-codes aiokafka's ``fetch_max_wait_ms`` to 1500 ms; after
   every seek, resume or rebalance the first fetch then idles that long (aiokafka sends no new
   fetch to a broker while one is in flight). The transport below sets it from the gateway
   settings (``kafka+llmq://`` URLs select it); not much shorter than 100 ms, as every empty
   fetch costs both the gateway and the broker CPU.
3. **Fetching in batches while records keep arriving** (``adapt_fetch_waits``): after a fetch
   that brought records the next one lets the broker gather for a few milliseconds, unless
   records of an urgent band (``gateway.prompt_fetch_bands``: CRITICAL, HIGH) came in the
   last second.
4. **The gateway's topics handed over in batches** (``_drain_messages``, with
   :mod:`pipeline.gateway.intake`): the records of a fetch go to the gateway as lists instead of
   one faust event each; every other topic keeps faust's path.
5. **Delivering a fetched message inline** on faust's own path: faust's fetcher wraps each
   message's delivery to the agents in ``wait_first`` (four tasks per message); the consumer
   below runs it inline when it does not need to wait.
6. **Paused partitions are not fetched** (``fetch_only_what_faust_reads``). faust's
   ``pause_partitions`` only leaves a partition out of what it reads; aiokafka goes on
   fetching it. The gateway's own changelog partitions are assigned to it and paused after
   recovery, so their records were fetched and never read, and while a fetched partition's
   records wait to be read aiokafka sends that broker no fetch for ``prefetch_backoff``
   (100 ms): each first write to a changelog partition held admission up to 100 ms (a quiet
   tenant's admission p99 86-94 ms, 10 ms with this), and every fetch named 24 partitions
   the gateway does not read.
7. **Incremental fetch sessions** (:mod:`pipeline.gateway.fetch_sessions`): aiokafka never
   opens one, so every fetch names, and every answer describes, all assigned partitions.
   On by default (``gateway.fetch_sessions``).
"""

from __future__ import annotations

import asyncio
import functools
import time

from faust.tables.recovery import Recovery
from faust.transport import drivers
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as faust_aiokafka

from pipeline.gateway.fetch_sessions import use_fetch_sessions
from pipeline.gateway.intake import Acks

_EVENT_WAIT = asyncio.Event.wait.__code__  # the consumer's suspend_flow is an asyncio.Event
FETCH_MAX_WAIT_MS = 100  # set by the gateway from its settings before the app starts
BUSY_FETCH_WAIT_MS = 3  # likewise: the fetch wait while data keeps arriving (0 = always FETCH_MAX_WAIT_MS)
BUSY_FETCH_MIN_BYTES = 1 << 20
PROMPT_FETCH_TOPICS: frozenset = frozenset()  # likewise: the topics whose records end the gathering
PROMPT_FETCH_HOLD_S = 1.0  # for this long after the last record of one of them
FETCH_SESSIONS = True  # likewise: incremental fetch sessions (pipeline.gateway.fetch_sessions)
_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    _applied = True
    original = Recovery.on_recovery_completed

    @functools.wraps(original)
    async def on_recovery_completed(self, generation_id: int = 0) -> None:
        consumer = self.app.consumer
        deferred: list = []
        resume, seek = consumer.resume_partitions, consumer.perform_seek

        def resume_after_seek(partitions):
            deferred.append(partitions)

        async def seek_then_resume():
            await seek()
            while deferred:
                resume(deferred.pop(0))

        consumer.resume_partitions, consumer.perform_seek = resume_after_seek, seek_then_resume
        try:
            await original(self, generation_id)
        finally:
            del consumer.resume_partitions, consumer.perform_seek  # back to the class's methods
            # No seek happened (nothing assigned, or a new rebalance began): resume as faust would.
            while deferred:
                resume(deferred.pop(0))

    Recovery.on_recovery_completed = on_recovery_completed
    drivers.TRANSPORTS.aliases["kafka+llmq"] = f"{__name__}:ShortFetchTransport"


class _ShortFetchThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_consumer(self, loop):
        consumer = super()._create_consumer(loop)
        # Read by aiokafka only when the consumer starts, which is after this.
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        start = consumer.start

        async def start_then_adapt():
            await start()
            fetch_only_what_faust_reads(consumer._fetcher, self.consumer._paused_partitions)
            if FETCH_SESSIONS:
                use_fetch_sessions(consumer._fetcher)
            if BUSY_FETCH_WAIT_MS:
                adapt_fetch_waits(consumer._fetcher, FETCH_MAX_WAIT_MS, BUSY_FETCH_WAIT_MS, BUSY_FETCH_MIN_BYTES,
                                  prompt_topics=PROMPT_FETCH_TOPICS, prompt_hold_s=PROMPT_FETCH_HOLD_S)

        consumer.start = start_then_adapt
        return consumer


def fetch_only_what_faust_reads(fetcher, paused_by_faust: set) -> None:
    """Before each round of fetch requests, pause in aiokafka the partitions faust has paused
    (``paused_by_faust``, the consumer's own set, changed on the app's event loop) and resume
    the ones it resumed; records fetched for a paused partition and not read are dropped, as
    aiokafka drops them itself when it pauses one (they are fetched again from the partition's
    position after a resume). Runs on the consumer thread's loop, as the fetcher does, so
    aiokafka's per-partition state changes only there. A resume takes effect at the fetcher's
    next round: at most its polling interval (0.2 s) or a fetch wait later."""
    actions = fetcher._get_actions_per_node
    records = fetcher._records
    paused_here: set = set()

    def get_actions_per_node(assignment):
        paused = paused_by_faust.copy()  # one C call: atomic against the app thread's changes
        for tp in assignment.tps:
            state = assignment.state_value(tp)
            if tp in paused:
                if not state.paused:
                    state.pause()
                    paused_here.add(tp)
                records.pop(tp, None)
            elif tp in paused_here:
                paused_here.discard(tp)
                if state.paused:
                    state.resume()
        return actions(assignment)

    fetcher._get_actions_per_node = get_actions_per_node


def adapt_fetch_waits(fetcher, idle_wait_ms: int, busy_wait_ms: int, busy_min_bytes: int, *,
                      prompt_topics: frozenset = frozenset(), prompt_hold_s: float = 1.0) -> None:
    """Fetch in batches while data keeps arriving, at once when it comes after a pause or while
    urgent requests are coming in.

    aiokafka sends the next fetch as soon as the last one's records are consumed, and with
    ``fetch.min.bytes`` 1 the broker answers it as soon as any partition has a record: under a
    steady stream that is a fetch per produced batch, each a request for every assigned
    partition encoded and decoded in Python (at 1,000 req/s a third of the gateway's CPU went to
    its consumer thread), and each one the broker answers. After a fetch that brought
    records, the next one asks the broker to wait up to ``busy_wait_ms`` for
    ``busy_min_bytes``; after an empty one, the next waits the idle ``idle_wait_ms`` but
    returns with the first record.

    One fetch names every partition, so the gathering also holds back a sparse CRITICAL request
    behind a BACKGROUND flood (its admission p99 went from 8-11 ms alone to 22-25 ms flooded).
    For ``prompt_hold_s`` after a fetch that brought records of ``prompt_topics`` (the urgent
    bands' request topics), fetches return with the first record again: the CPU of fetching
    at once is spent only while urgent requests are arriving.
    """
    proc = fetcher._proc_fetch_request
    records = fetcher._records if prompt_topics else {}  # partition → its records not consumed yet
    prompt_until = [0.0]

    async def proc_then_adapt(assignment, node_id, request):
        has_data = await proc(assignment, node_id, request)
        gather = has_data
        if has_data and prompt_topics:
            now = time.monotonic()
            if any(tp.topic in prompt_topics for tp in records):
                prompt_until[0] = now + prompt_hold_s
            gather = now >= prompt_until[0]
        if gather:
            fetcher._fetch_max_wait_ms, fetcher._fetch_min_bytes = busy_wait_ms, busy_min_bytes
        else:
            fetcher._fetch_max_wait_ms, fetcher._fetch_min_bytes = idle_wait_ms, 1
        return has_data

    fetcher._proc_fetch_request = proc_then_adapt


class _ShortFetchConsumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self):
        return _ShortFetchThread(self, loop=self.loop, beacon=self.beacon)

    async def wait_first(self, *coros, timeout=None):
        """faust hands every fetched message to its streams as ``wait_first(deliver(message),
        suspend_flow.wait())``: four tasks and an ``asyncio.wait`` per message, and a trip
        through the event loop that lets an agent wake for each single message. Delivery
        almost never has to wait (it puts the event in the agent's queue), so it is first run
        inline; only if it does wait (a full queue) does it continue as faust would run it."""
        if (len(coros) == 2 and timeout is None and getattr(coros[1], "cr_code", None) is _EVENT_WAIT
                and not self.suspend_flow.is_set()):
            deliver, suspended = coros
            try:
                pending = deliver.send(None)
            except StopIteration:
                suspended.close()
                return None
            coros = (_Continue(deliver, pending).run(), suspended)
        return await super().wait_first(*coros, timeout=timeout)


    async def _drain_messages(self, fetcher) -> None:
        """faust's fetch loop, with the gateway's topics handed over in batches (see
        :mod:`pipeline.gateway.intake`); without an intake on the app, faust's own loop."""
        intake = getattr(self.app, "llmq_intake", None)
        if intake is None:
            return await super()._drain_messages(fetcher)
        consumer_should_stop, fetcher_should_stop = self._stopped.is_set, fetcher._stopped.is_set
        set_flag, unset_flag = self.diag.set_flag, self.diag.unset_flag
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                set_flag(CONSUMER_FETCHING)
                records, active = await self._wait_next_records(1.0)
                if records and not self.should_stop:
                    if self.flow_active:
                        await self._deliver_fetched(intake, records, active)
                    else:  # as faust's getmany: records fetched across a rebalance are read again
                        try:
                            await self.perform_seek()
                        except Exception as exc:  # noqa: BLE001
                            self.log.warning(f"exception performing seek when flow not active {exc}")
                unset_flag(CONSUMER_FETCHING)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise
        finally:
            unset_flag(CONSUMER_FETCHING)

    async def _deliver_fetched(self, intake, records, active) -> None:
        app = self.app
        generation = app.consumer_generation_id
        buffered = self._buffered_partitions
        rank = intake.rank
        by_topic: dict = {}
        others = []
        for tp, recs in records.items():
            if active is not None and tp not in active and tp not in buffered:
                continue
            app.monitor.track_tp_end_offset(tp, self.highwater(tp))
            if tp.topic in rank:
                by_topic.setdefault(tp.topic, []).append((tp, recs))
            else:
                others.append((tp, recs))
        for topic in sorted(by_topic, key=rank.__getitem__):
            if not await self._deliver_batches(intake.handlers[topic], topic, by_topic[topic], generation,
                                               intake.max_batch):
                return
        for tp, recs in others:
            if not await self._deliver_one_by_one(tp, recs, generation):
                return

    def _still_current(self, generation) -> bool:
        return self.flow_active and not self.should_stop and self.app.consumer_generation_id == generation

    async def _deliver_batches(self, handle, topic, tp_records, generation, max_batch) -> bool:
        """Hand ``topic``'s fetched records to ``handle`` in batches; False once a rebalance
        began (what was not handled yet is read again after it)."""
        read_offset = self._read_offset
        acks_enabled = self.app.topics.acks_enabled_for(topic)
        pending = []  # (tp, record), each partition's after its read offset
        for tp, recs in tp_records:
            r_offset = read_offset[tp]
            for rec in recs:
                offset = rec.offset
                if r_offset is None or offset >= r_offset:
                    if r_offset and offset - r_offset > 1 and acks_enabled:
                        await self._add_gap(tp, r_offset + 1, offset)  # as faust: offsets no message has
                    pending.append((tp, rec))
                    r_offset = offset
        for start in range(0, len(pending), max_batch):
            if start:
                await asyncio.sleep(0)  # a long fetch does not hold the loop (timers, web, other topics)
            if not self._still_current(generation):
                return False
            commit_every = self._commit_every
            if commit_every is not None and self._n_acked >= commit_every:
                self._n_acked = 0
                await self.commit()
                if not self._still_current(generation):
                    return False
            chunk = pending[start:start + max_batch]
            acks = Acks(self)
            offsets = acks.offsets
            for tp, rec in chunk:
                lst = offsets.get(tp)
                if lst is None:
                    lst = offsets[tp] = []
                lst.append(rec.offset)
            self._unacked_messages.add(acks)
            for tp, lst in offsets.items():
                read_offset[tp] = lst[-1]
            handle([rec for _, rec in chunk], acks)
        return True

    async def _deliver_one_by_one(self, tp, recs, generation) -> bool:
        """faust's own delivery, for the topics the intake does not take."""
        read_offset = self._read_offset
        acks_enabled_for = self.app.topics.acks_enabled_for
        callback = self.callback
        for rec in recs:
            if not self._still_current(generation):
                return False
            message = self._to_message(tp, rec)
            offset = message.offset
            r_offset = read_offset[tp]
            if r_offset is None or offset >= r_offset:
                if offset - (r_offset or 0) > 1 and r_offset and acks_enabled_for(message.topic):
                    await self._add_gap(tp, r_offset + 1, offset)
                await self.wait_first(callback(message), self.suspend_flow.wait())
                read_offset[tp] = offset
        return True


class _Continue:
    """Awaitable that resumes a coroutine which has already run up to its first suspension
    (``first``: what it yielded there, handed on to the task that now drives it)."""

    def __init__(self, coro, first):
        self.coro, self.first = coro, first

    async def run(self):
        return await self

    def __await__(self):
        coro, yielded = self.coro, self.first
        while True:
            try:
                sent = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # thrown into the task (e.g. cancellation): pass it on
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


class ShortFetchTransport(faust_aiokafka.Transport):
    Consumer = _ShortFetchConsumer
