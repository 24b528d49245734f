"""The client SDK for upstream services: submit requests, await their answers, stream them.

``LlmqClient`` (threads) and ``AsyncLlmqClient`` (asyncio) share one engine:

* **Replies only to their owner.** A client owns one or a few *reply partitions* (one chosen at
  random at start unless ``reply_partitions`` names them) and writes their number into every
  request it submits (``reply_partition``); workers and the gateway write its answers, QUEUED
  events and streamed chunks there, and its one listener reads only those partitions of the
  response and chunk topics. ``reply_to`` names a topic of its own instead (a per-tenant reply
  topic, ``<prefix>.replies.<tenant>``, is what Kafka ACLs can isolate: they grant topics and
  prefixes, not partitions). Reading every response is :class:`AllResponses`, for audit.
* ``submit`` encodes the request, routes it to its priority's topic keyed by tenant with an
  idempotent producer, and returns once the broker acknowledged it, and, for a request that
  asks (``notify_queued``), what the gateway said: its QUEUED event (position, ETA) or the
  refusal it answered at once.
* ``result`` waits for the terminal response with that request_id. The listener reads from the
  positions it had *before* the first submit, so a fast answer is never missed; responses
  nobody waits for are dropped, and duplicates (possible after a worker crash) are ignored after
  the first. ``QUEUED`` events never resolve it: ``queued(request_id)`` returns the latest one.
* ``stream`` submits a request with ``stream`` set and yields its chunks in order, each once
  (:mod:`pipeline.chunks`), then holds the terminal response.
* A tenant whose registry record requires signed requests gets them signed: pass its secret as
  ``signing_secret`` (bytes, or a mapping tenant → bytes).

Example::

    with LlmqClient.from_settings() as client:
        response = client.submit_and_wait(Request.new("tenant-a", "Hello", priority=Priority.HIGH))
        print(response.status, response.output)
        with client.stream(Request.new("tenant-a", "Tell me more")) as stream:
            for chunk in stream:
                print(chunk.delta, end="")
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from pipeline.chunks import ChunkOrder
from pipeline.config import Settings
from pipeline.errors import AuthenticationError, DecodeError, KafkaOperationError, LlmqError, RequestTimeoutError
from pipeline.models import Chunk, Request, Response, Status
from pipeline.serde import Codec
from pipeline.renewing_producer import RenewingProducer
from pipeline.serde.factory import codec_for
from pipeline.tenants.signing import signature_header

log = logging.getLogger(__name__)

_EARLY_RESPONSES = 1000
#: No response for this long while some are awaited: check the listener is not stuck.
_LISTENER_STALL_S = 10.0
#: A COMPLETED answer whose stream has not ended yet: how long its missing chunks may still come
#: before the rest of the stream is taken from the answer's output.
_STREAM_GRACE_S = 0.5
#: submit() of a request with notify_queued: how long it waits for the gateway's word (a
#: pipeline without a gateway never sends one).
_QUEUED_WAIT_S = 10.0


@dataclass(frozen=True)
class Submitted:
    request_id: str
    topic: str
    partition: int
    offset: int
    #: What the gateway said, for a request that asked (``notify_queued``): its QUEUED event, or
    #: the terminal answer when it refused the request at once. None when not asked, or when
    #: no word came within the wait (a pipeline without a gateway sends none).
    response: Response | None = None

    @property
    def status(self) -> Status | None:
        return None if self.response is None else self.response.status

    @property
    def queue_position(self) -> int | None:
        return None if self.response is None else self.response.queue_position

    @property
    def eta_ms(self) -> int | None:
        return None if self.response is None else self.response.eta_ms


class Correlator:
    """Matches responses and chunks to whoever waits for them; no Kafka in here.

    A waiter's future resolves with the first *terminal* response to its request id.
    ``QUEUED`` events only replace the waiter's latest progress event (and resolve a
    :meth:`first_word` future); for requests nobody waits for they are dropped, so they cannot
    push answers out of the small buffer of early terminal responses kept for a late
    ``expect``. A stream's sink is handed its chunks and its terminal response as they come.
    """

    def __init__(self, early_max: int = _EARLY_RESPONSES):
        self._waiters: dict[str, Future] = {}
        self._early: OrderedDict[str, Response] = OrderedDict()
        self._queued: dict[str, Response] = {}
        self._first: dict[str, Future] = {}
        self._sinks: dict[str, Callable[[Chunk | Response], None]] = {}
        self._early_max = early_max
        self._lock = threading.Lock()

    def expect(self, request_id: str) -> Future:
        with self._lock:
            fut = self._waiters.get(request_id)
            if fut is None:
                fut = self._waiters[request_id] = Future()
                early = self._early.pop(request_id, None)
                if early is not None:
                    fut.set_result(early)
            return fut

    def first_word(self, request_id: str) -> Future:
        """A future resolved by the request's first QUEUED event or its terminal response."""
        with self._lock:
            fut = self._first.get(request_id)
            if fut is None:
                fut = self._first[request_id] = Future()
                done = self._waiters.get(request_id)
                if done is not None and done.done() and done.exception() is None:
                    fut.set_result(done.result())
            return fut

    def attach(self, request_id: str, sink: Callable[[Chunk | Response], None]) -> None:
        """Hand ``sink`` every chunk and the terminal response of ``request_id`` (on the listener thread)."""
        with self._lock:
            self._sinks[request_id] = sink

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._waiters.pop(request_id, None)
            self._queued.pop(request_id, None)
            self._first.pop(request_id, None)
            self._sinks.pop(request_id, None)

    def queued(self, request_id: str) -> Response | None:
        with self._lock:
            return self._queued.get(request_id)

    def deliver(self, response: Response) -> None:
        request_id = response.request_id
        with self._lock:
            fut = self._waiters.get(request_id)
            first = self._first.pop(request_id, None)
            if first is not None and not first.done():
                first.set_result(response)
            sink = self._sinks.get(request_id)
            if not response.status.is_terminal:
                if fut is not None and not fut.done():
                    self._queued[request_id] = response
                return
            if sink is not None:
                sink(response)
            if fut is None:
                # Not (yet) awaited: keep the newest few in case `result` is asked late.
                self._early[request_id] = response
                if len(self._early) > self._early_max:
                    self._early.popitem(last=False)
                return
            if not fut.done():
                self._queued.pop(request_id, None)
                fut.set_result(response)

    def deliver_chunk(self, chunk: Chunk) -> None:
        sink = self._sinks.get(chunk.request_id)
        if sink is not None:
            sink(chunk)

    def waiting(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._waiters.values()) or bool(self._sinks)

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            for fut in [*self._waiters.values(), *self._first.values()]:
                if not fut.done():
                    fut.set_exception(error)
            sinks = list(self._sinks.values())
        for sink in sinks:
            sink(error)


class StreamState:
    """What a stream has seen: chunks in order (each once), its terminal response. No I/O.

    ``feed`` takes what the listener delivered and returns the chunks to hand out now. The
    stream has ended once its last chunk (``finish_reason``) was handed out, or its answer is
    not COMPLETED. A COMPLETED answer whose chunks stopped short (a worker that streams nothing,
    chunks lost with a crashed worker) ends it after a grace, with the rest of the output as one
    last chunk (:meth:`settle`).
    """

    def __init__(self, request: Request):
        self.request = request
        self.order = ChunkOrder()
        self.response: Response | None = None
        self.error: BaseException | None = None
        self.text: list[str] = []
        self.seq = 0
        self.ended = False

    def feed(self, item) -> list[Chunk]:
        if isinstance(item, BaseException):
            self.error, self.ended = item, True
            return []
        if isinstance(item, Response):
            self.response = item
            if item.status is not Status.COMPLETED:
                self.ended = True
            return []
        out = []
        for chunk in self.order.add(item):
            if self.ended:
                break
            out.append(chunk)
            self.text.append(chunk.delta)
            self.seq = chunk.seq + 1
            if chunk.last:
                self.ended = True
        return out

    @property
    def answered(self) -> bool:
        """The answer is COMPLETED but the stream has not ended: :meth:`settle` after a grace."""
        return not self.ended and self.response is not None

    def settle(self) -> list[Chunk]:
        if self.ended or self.response is None:
            return []
        # What came past a gap that never filled, then whatever the chunks did not cover.
        out = [c for c in self.order.rest() if not c.last]
        for chunk in out:
            self.text.append(chunk.delta)
            self.seq = chunk.seq + 1
        self.ended = True
        resp = self.response
        streamed = "".join(self.text)
        output = resp.output or ""
        rest = output[len(streamed):] if output.startswith(streamed) else ""
        return out + [Chunk(request_id=resp.request_id, tenant_id=resp.tenant_id, seq=self.seq, delta=rest,
                            finish_reason=resp.finish_reason or "stop", emitted_at=resp.finished_at,
                            worker_id=resp.worker_id)]


class LoopWaker:
    """Hands items from the listener thread to one asyncio loop: one wake-up per batch, however
    many streams it feeds (each call_soon_threadsafe writes to the loop's wake-up pipe)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: list = []
        self._lock = threading.Lock()

    def push(self, fn: Callable, item) -> None:
        with self._lock:
            self._pending.append((fn, item))
            if len(self._pending) > 1:
                return  # a wake-up is on its way and will take this one too
        try:
            self.loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop is closed: nobody to tell
            pass

    def _run(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        for fn, item in items:
            fn(item)


def _settle(fut: Future, value=None, *, error: BaseException | None = None) -> None:
    """Resolve ``fut`` unless its waiter gave up first. An asyncio caller's timeout cancels the
    future it wrapped (``asyncio.wrap_future``); setting a cancelled future raises, which, from
    inside a delivery callback, killed the thread polling the producer, and the client delivered
    nothing more (serve answered 503 to every request after its first submit timeout)."""
    if fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except InvalidStateError:
        pass  # cancelled between the check and the set


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _secret_for(signing_secret, tenant: str) -> bytes | None:
    if signing_secret is None or isinstance(signing_secret, bytes):
        return signing_secret
    return signing_secret.get(tenant)


class ClientEngine:
    def __init__(self, settings: Settings, codec: Codec | None = None, listen: bool = True, *,
                 reply_partitions: Iterable[int] | None = None, reply_to: str | None = None,
                 signing_secret: bytes | Mapping[str, bytes] | None = None, producer_config: dict | None = None):
        self.settings = settings
        self.codec = codec or codec_for(settings.serde)
        self.reply_to = reply_to
        self.reply_topic = reply_to or settings.topics.responses
        self.chunk_topic = reply_to or settings.topics.chunks
        self.reply_partitions: list[int] = sorted(set(reply_partitions)) if reply_partitions is not None else []
        self.signing_secret = signing_secret
        # A client waits for each answer, so its requests go out within a millisecond rather than
        # llmq's 5 (a burst still shares produce requests); [kafka.properties] still wins.
        self.producer = RenewingProducer(
            settings.kafka.producer_config(**{"client.id": "llmq-client", "linger.ms": 1, **(producer_config or {})}),
            stall_s=settings.kafka.producer_renew_after_ms / 1000.0)
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll_producer, name="llmq-client-producer", daemon=True)
        self._poller.start()
        self.correlator = Correlator()
        self._listener: threading.Thread | None = None
        self._listener_error: BaseException | None = None
        self._next = 0
        if listen:
            try:
                self._start_listener()
            except BaseException:
                # Not authorized, no topic, wrong password: leave no producer thread behind.
                self._closed.set()
                self._poller.join(2)
                self.producer.flush(0)
                raise

    # -- submit ---------------------------------------------------------------------------

    def addressed(self, request: Request) -> Request:
        """``request`` naming this client's reply partition (and topic), unless it names its own."""
        if request.reply_partition is not None or not self.reply_partitions:
            return request if self.reply_to is None or request.reply_to else replace(request, reply_to=self.reply_to)
        parts = self.reply_partitions
        self._next += 1
        return replace(request, reply_partition=parts[self._next % len(parts)],
                       reply_to=request.reply_to or self.reply_to)

    def prepared(self, request: Request, track: bool, want_word: bool) -> tuple[Request, Future | None]:
        """``request`` as a submit writes it, its answer awaited (``track``), and the future of
        the gateway's first word on it (where it is queued, or why it was refused) when it asks
        for one (``notify_queued``) and the caller waits for it."""
        request = self.addressed(request)
        word = None
        if track:
            self.expect(request.request_id)
            if request.notify_queued and want_word:
                word = self.correlator.first_word(request.request_id)
        return request, word

    def submit_future(self, request: Request) -> Future:
        topic = self.settings.topics.request_topic(request.priority)
        value = self.codec.encode_request(request, self.settings.serde.wire_format, topic)
        secret = _secret_for(self.signing_secret, request.tenant_id)
        headers = [signature_header(secret, value)] if secret else None
        fut: Future = Future()

        def delivered(err, msg):
            if err is not None:
                _settle(fut, error=KafkaOperationError(f"submit {request.request_id} to {topic}", err.str(), err))
            else:
                _settle(fut, Submitted(request.request_id, msg.topic(), msg.partition(), msg.offset()))

        while True:
            try:
                self.producer.produce(topic, value, request.tenant_id.encode(), headers=headers, on_delivery=delivered)
                break
            except BufferError:
                time.sleep(0.01)  # the poll thread drains the queue
        return fut

    def cancel(self, request_id: str, reason: str) -> Future:
        from pipeline.cancellations import cancellation_record

        key, value = cancellation_record(request_id, reason)
        fut: Future = Future()
        self.producer.produce(
            self.settings.topics.cancellations, value, key,
            on_delivery=lambda err, msg: _settle(fut, error=KafkaOperationError(f"cancel {request_id}", err.str(), err))
            if err is not None else _settle(fut, None))
        return fut

    def _poll_producer(self) -> None:
        while not self._closed.is_set():
            try:
                self.producer.poll(0.05)
            except Exception:  # noqa: BLE001 (a callback's bug must not stop every later delivery)
                log.exception("a delivery callback failed; polling goes on")

    # -- responses ------------------------------------------------------------------------

    def expect(self, request_id: str) -> Future:
        """Register interest in a response; call before submitting to be race-free."""
        return self.correlator.expect(request_id)

    def forget(self, request_id: str) -> None:
        self.correlator.forget(request_id)

    def _start_listener(self) -> None:
        consumer, client_errors = _reply_consumer(self.settings, "llmq-client-listener")
        try:
            tmd = _describe(consumer, self.settings, self.reply_topic, client_errors)
            partitions = sorted(tmd.partitions)
            topics = [self.reply_topic]
            if self.chunk_topic != self.reply_topic:
                chunks = _describe(consumer, self.settings, self.chunk_topic, client_errors, required=False)
                if chunks is None:
                    log.info("no chunk topic %s: streamed answers arrive whole", self.chunk_topic)
                else:
                    topics.append(self.chunk_topic)
                    # A reply partition must exist in both topics.
                    partitions = [p for p in partitions if p in chunks.partitions]
            if not self.reply_partitions:
                self.reply_partitions = [random.choice(partitions)]
            missing = [p for p in self.reply_partitions if p not in partitions]
            if missing:
                raise LlmqError(f"reply partition {missing[0]} does not exist in {' and '.join(topics)} "
                                f"(partitions 0-{len(partitions) - 1})")
            # Explicit high watermarks, not OFFSET_END: END is resolved lazily at first fetch,
            # which could skip a response that arrives in between.
            consumer.assign([TopicPartition(t, p, _high_watermark(consumer, t, p))
                             for t in topics for p in self.reply_partitions])
        except BaseException:
            consumer.close()
            raise
        self._listener = threading.Thread(target=self._listen, args=(consumer,), name="llmq-client-listener",
                                          daemon=True)
        self._listener.start()

    def _listen(self, consumer: Consumer) -> None:
        last_message = last_check = time.monotonic()
        chunk_topic = self.chunk_topic if self.chunk_topic != self.reply_topic else None
        try:
            while not self._closed.is_set():
                # consume(n, timeout) waits for n messages or the timeout, whichever is
                # first; poll() returns at the first one, then take whatever else is ready.
                first = consumer.poll(0.1)
                if first is None:
                    now = time.monotonic()
                    if now - last_message > _LISTENER_STALL_S and now - last_check > _LISTENER_STALL_S:
                        last_check = now
                        self.unstick(consumer)
                    continue
                last_message = time.monotonic()
                for msg in [first, *consumer.consume(499, 0)]:
                    if msg.error() is not None or msg.value() is None:
                        continue
                    self._deliver(msg, msg.topic() == chunk_topic)
        except BaseException as exc:  # surfaced to waiters instead of dying silently
            self._listener_error = exc
            self.correlator.fail_all(LlmqError(f"response listener failed: {exc}"))
        finally:
            consumer.close()

    def _deliver(self, msg, is_chunk: bool) -> None:
        value = msg.value()
        try:
            if is_chunk:
                self.correlator.deliver_chunk(self.codec.decode_chunk(value))
                return
            try:
                response = self.codec.decode_response(value)
            except DecodeError as exc:
                if self.reply_to is None or exc.reason not in ("unknown_fingerprint", "unknown_schema_id"):
                    raise
                # A reply topic of its own carries both answers and chunks.
                self.correlator.deliver_chunk(self.codec.decode_chunk(value))
                return
            self.correlator.deliver(response)
        except DecodeError as exc:
            log.warning("undecodable reply at %s[%d]@%d: %s", msg.topic(), msg.partition(), msg.offset(), exc)

    def unstick(self, consumer: Consumer) -> None:
        """An assign()-ed librdkafka consumer can stop fetching after a broker restart
        (librdkafka#5153). If responses are waiting past our position and nothing came for a
        while, assign the partitions again at the positions reached."""
        if not self.correlator.waiting():
            return
        try:
            positions = consumer.position(consumer.assignment())
            behind = [tp for tp in positions
                      if tp.offset >= 0 and consumer.get_watermark_offsets(tp, timeout=2, cached=False)[1] > tp.offset]
            if behind:
                log.warning("response listener made no progress for %.0f s with %d partitions behind; "
                            "re-assigning at its positions", _LISTENER_STALL_S, len(behind))
                consumer.assign(positions)
        except KafkaException as exc:
            log.info("response listener check failed (%s); will retry", exc)

    def close(self, timeout: float = 10.0) -> None:
        remaining = self.producer.flush(timeout)
        self._closed.set()
        self._poller.join(2)
        if self._listener is not None:
            self._listener.join(5)
        if remaining:
            log.warning("%d submitted requests were not acknowledged before close", remaining)


def _reply_consumer(settings: Settings, client_id: str) -> tuple[Consumer, list]:
    client_errors: list = []
    consumer = Consumer(settings.kafka.consumer_config(
        "llmq-client-unused",  # assign(): no group membership, no commits
        **{"client.id": client_id, "enable.partition.eof": False, "isolation.level": "read_committed",
           "fetch.wait.max.ms": 10, "error_cb": client_errors.append}))
    return consumer, client_errors


def _describe(consumer: Consumer, settings: Settings, topic: str, client_errors: list, required: bool = True):
    try:
        md = consumer.list_topics(topic, timeout=10)
    except KafkaException as exc:
        # The error callback that says why runs only inside poll(): serve it before judging.
        deadline = time.monotonic() + 2.0
        auth: list = []
        while not auth and time.monotonic() < deadline:
            consumer.poll(0.1)
            auth = [e for e in client_errors if e.code() == KafkaError._AUTHENTICATION]
        if auth:
            user = settings.kafka.sasl_username
            raise AuthenticationError(
                "connect", f"the broker refused the credentials of {user!r} ({settings.kafka.sasl_mechanism}):"
                           f" {auth[-1].str()}", auth[-1]) from None
        raise KafkaOperationError(f"describe {topic}", str(exc.args[0]), exc.args[0]) from exc
    tmd = md.topics.get(topic)
    if tmd is not None and tmd.error is not None and tmd.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        if not required:
            log.info("not authorized to read %s: streamed answers arrive whole", topic)
            return None
        raise KafkaOperationError(f"read replies from {topic}",
                                  f"not authorized (principal {settings.kafka.sasl_username or 'ANONYMOUS'} "
                                  "needs READ on it: see `llmq acls`)", tmd.error)
    if tmd is None or tmd.error is not None or not tmd.partitions:
        if not required:
            return None
        raise LlmqError(f"reply topic {topic!r} does not exist; run `llmq topics create`")
    return tmd


def _high_watermark(consumer: Consumer, topic: str, partition: int, timeout: float = 30.0) -> int:
    # A partition without a leader yet (topic just created, broker restarting) fails
    # fast; retry rather than fall back to a lazily resolved end offset.
    deadline = time.monotonic() + timeout
    while True:
        try:
            return consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=5)[1]
        except KafkaException as exc:
            if time.monotonic() > deadline:
                raise KafkaOperationError(f"read end offset of {topic}[{partition}]", str(exc.args[0]),
                                          exc.args[0]) from exc
            time.sleep(0.2)


class ReplyStream:
    """The chunks of one streamed request, in order (iterate), then its terminal ``response``.

    Ends at the last chunk, or early when the answer is not COMPLETED (``response`` says why);
    ``RequestTimeoutError`` when neither comes before the timeout.
    """

    def __init__(self, client: LlmqClient, request: Request, timeout: float):
        self._client = client
        self._state = StreamState(request)
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: list[Chunk] = []
        self._deadline = time.monotonic() + timeout
        self.request = request
        self._timeout = timeout

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def __iter__(self) -> ReplyStream:
        return self

    def __next__(self) -> Chunk:
        state = self._state
        while not self._ready:
            if state.ended:
                raise StopIteration
            wait = _STREAM_GRACE_S if state.answered else self._deadline - time.monotonic()
            try:
                item = self._items.get(timeout=max(0.0, wait))
            except queue.Empty:
                if state.answered:
                    self._ready.extend(state.settle())
                    continue
                raise RequestTimeoutError(self.request_id, self._timeout) from None
            self._ready.extend(state.feed(item))
            if state.error is not None:
                raise state.error
        return self._ready.pop(0)

    @property
    def queued(self) -> Response | None:
        return self._client.queued(self.request_id)

    @property
    def response(self) -> Response:
        """The terminal response (waits for it, up to the stream's deadline)."""
        if self._state.response is None:
            self._state.response = self._client.result(self.request_id, max(0.0, self._deadline - time.monotonic()))
        return self._state.response

    def close(self) -> None:
        self._client.forget(self.request_id)

    def __enter__(self) -> ReplyStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncReplyStream:
    """:class:`ReplyStream` for asyncio: ``async for chunk in stream``; ``await stream.next(timeout)``
    returns None when nothing came within ``timeout`` (for heartbeats), without ending it."""

    def __init__(self, client: AsyncLlmqClient, request: Request, timeout: float):
        self._client = client
        self._state = StreamState(request)
        # A deque and one waiter future, not an asyncio.Queue under wait_for: no task per chunk.
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._ready: list[Chunk] = []
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + timeout
        self._timeout = timeout
        self.request = request

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def push(self, item) -> None:
        """Hand the stream a chunk, the terminal response or an error (on its loop)."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def abort(self, error: BaseException) -> None:
        """End the stream: its next read raises ``error``."""
        self.push(error)

    def __aiter__(self) -> AsyncReplyStream:
        return self

    async def __anext__(self) -> Chunk:
        chunk = await self.next()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def next(self, timeout: float | None = None) -> Chunk | None:
        """The next chunk; None at the end, or when ``timeout`` passed first (check :attr:`ended`)."""
        state, loop, items = self._state, self._loop, self._items
        until = None if timeout is None else loop.time() + timeout
        while not self._ready:
            if state.ended:
                return None
            if not items:
                now = loop.time()
                wait = _STREAM_GRACE_S if state.answered else self._deadline - now
                if until is not None and until - now < wait:
                    wait = until - now
                if wait > 0:
                    waiter = self._waiter = loop.create_future()
                    timer = loop.call_later(wait, _wake, waiter)
                    try:
                        await waiter
                    finally:
                        timer.cancel()
                        self._waiter = None
                if not items:
                    if state.answered:
                        self._ready.extend(state.settle())
                        continue
                    now = loop.time()
                    if until is not None and now >= until and now < self._deadline:
                        return None
                    raise RequestTimeoutError(self.request_id, self._timeout)
            self._ready.extend(state.feed(items.popleft()))
            if state.error is not None:
                raise state.error
        return self._ready.pop(0)

    @property
    def ended(self) -> bool:
        return self._state.ended and not self._ready

    @property
    def queued(self) -> Response | None:
        return self._client.queued(self.request_id)

    async def response(self) -> Response:
        """The terminal response (waits for it, up to the stream's deadline)."""
        if self._state.response is None:
            left = self._deadline - asyncio.get_running_loop().time()
            self._state.response = await self._client.result(self.request_id, max(0.0, left))
        return self._state.response

    def close(self) -> None:
        self._client.forget(self.request_id)

    async def __aenter__(self) -> AsyncReplyStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class LlmqClient:
    """Synchronous client. Thread-safe; one per process is enough.

    ``reply_partitions``: the partitions of the response and chunk topics it reads (default one
    chosen at random); ``reply_to``: a reply topic of its own instead of the response topic.
    """

    def __init__(self, settings: Settings | None = None, *, codec: Codec | None = None, listen: bool = True,
                 reply_partitions: Iterable[int] | None = None, reply_to: str | None = None,
                 signing_secret: bytes | Mapping[str, bytes] | None = None, producer_config: dict | None = None):
        #: The Kafka side (producer, listener, correlation), shared in design with AsyncLlmqClient.
        self.engine = ClientEngine(settings or Settings.load(), codec, listen, reply_partitions=reply_partitions,
                                   reply_to=reply_to, signing_secret=signing_secret, producer_config=producer_config)

    @classmethod
    def from_settings(cls, path: str | None = None, **kwargs) -> "LlmqClient":
        return cls(Settings.load(path), **kwargs)

    @property
    def reply_partitions(self) -> list[int]:
        return list(self.engine.reply_partitions)

    def submit(self, request: Request, timeout: float = 30.0, track: bool = True,
               wait_queued: float = _QUEUED_WAIT_S) -> Submitted:
        """Produce ``request`` and return once the broker acknowledged it, and (a request with
        ``notify_queued``) once the gateway said where it is queued or why it refused it, or
        its answer came (a fast worker's answer can overtake the QUEUED word).

        With ``track`` (default) its response is kept for :meth:`result`; pass
        ``track=False`` for fire-and-forget submits so nothing is held for them.
        """
        request, word = self.engine.prepared(request, track, wait_queued > 0)
        started = time.monotonic()
        fut = self.engine.submit_future(request)
        try:
            sub = fut.result(timeout)
        except TimeoutError:
            raise KafkaOperationError(f"submit {request.request_id}", f"not acknowledged within {timeout}s") from None
        if word is None:
            return sub
        try:
            return replace(sub, response=word.result(max(0.0, min(wait_queued, timeout - (time.monotonic() - started)))))
        except TimeoutError:
            return sub

    def submit_nowait(self, request: Request, track: bool = True) -> Future:
        """Produce without waiting; the future resolves to :class:`Submitted` on acknowledgement."""
        request = self.engine.addressed(request)
        if track:
            self.engine.expect(request.request_id)
        return self.engine.submit_future(request)

    def stream(self, request: Request, timeout: float = 60.0) -> ReplyStream:
        """Submit ``request`` streamed; iterate the result for its chunks (see :class:`ReplyStream`)."""
        request = self.engine.addressed(replace(request, stream=True))
        stream = ReplyStream(self, request, timeout)
        self.engine.correlator.attach(request.request_id, stream._items.put)
        try:
            self.submit(request, timeout=timeout, wait_queued=0)
        except BaseException:
            stream.close()
            raise
        return stream

    def cancel(self, request_id: str, reason: str = "cancelled by the client", timeout: float = 30.0) -> None:
        """Ask workers to answer ``request_id`` CANCELLED (best effort: a finished request stays finished)."""
        self.engine.cancel(request_id, reason).result(timeout)

    def response_future(self, request_id: str) -> Future:
        """A future resolved with the terminal response to ``request_id`` (for callbacks, many at once).

        ``QUEUED`` events never resolve it (see :meth:`queued`). Register it before
        submitting; call :meth:`result` or :meth:`forget` when done.
        """
        return self.engine.expect(request_id)

    def queued(self, request_id: str) -> Response | None:
        """The latest ``QUEUED`` event (``queue_position``, ``eta_ms``) of a tracked request.

        ``None`` until one arrives (the gateway sends them only to requests with
        ``notify_queued``), and again once the terminal response has arrived or the
        request is forgotten. Poll it while :meth:`result` waits in another thread.
        """
        return self.engine.correlator.queued(request_id)

    def forget(self, request_id: str) -> None:
        """Stop holding the response to ``request_id``."""
        self.engine.forget(request_id)

    def result(self, request_id: str, timeout: float = 60.0) -> Response:
        """Wait for the terminal response to ``request_id`` (``QUEUED`` events are not one)."""
        fut = self.engine.expect(request_id)
        try:
            return fut.result(timeout)
        except TimeoutError:
            raise RequestTimeoutError(request_id, timeout) from None
        finally:
            self.engine.forget(request_id)

    def submit_and_wait(self, request: Request, timeout: float = 60.0) -> Response:
        started = time.monotonic()
        self.submit(request, timeout=timeout, wait_queued=0)
        return self.result(request.request_id, max(0.0, timeout - (time.monotonic() - started)))

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LlmqClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncLlmqClient:
    """asyncio client: the same engine, awaited (same keyword arguments as :class:`LlmqClient`)."""

    def __init__(self, settings: Settings | None = None, *, codec: Codec | None = None,
                 reply_partitions: Iterable[int] | None = None, reply_to: str | None = None,
                 signing_secret: bytes | Mapping[str, bytes] | None = None, producer_config: dict | None = None):
        self.engine = ClientEngine(settings or Settings.load(), codec, listen=True, reply_partitions=reply_partitions,
                                   reply_to=reply_to, signing_secret=signing_secret, producer_config=producer_config)
        self._wakers: dict[asyncio.AbstractEventLoop, LoopWaker] = {}

    @property
    def reply_partitions(self) -> list[int]:
        return list(self.engine.reply_partitions)

    @property
    def listening(self) -> bool:
        """Whether its reply listener runs (it stops only on a failure, which waiters are told)."""
        listener = self.engine._listener
        return listener is not None and listener.is_alive()

    def addressed(self, request: Request) -> Request:
        """``request`` as :meth:`submit` writes it (naming this client's reply partition)."""
        return self.engine.addressed(request)

    async def submit(self, request: Request, timeout: float = 30.0, track: bool = True,
                     wait_queued: float = _QUEUED_WAIT_S) -> Submitted:
        """See :meth:`LlmqClient.submit`."""
        request, word = self.engine.prepared(request, track, wait_queued > 0)
        loop = asyncio.get_running_loop()
        started = loop.time()
        fut = self.engine.submit_future(request)
        try:
            sub = await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            raise KafkaOperationError(f"submit {request.request_id}", f"not acknowledged within {timeout}s") from None
        if word is None:
            return sub
        left = max(0.0, min(wait_queued, timeout - (loop.time() - started)))
        try:
            return replace(sub, response=await asyncio.wait_for(asyncio.wrap_future(word), left))
        except asyncio.TimeoutError:
            return sub

    def stream(self, request: Request, timeout: float = 60.0) -> _StreamStart:
        """``async with client.stream(req) as s: async for chunk in s`` (or ``s = await client.stream(req)``)."""
        return _StreamStart(self, request, timeout)

    async def open_stream(self, request: Request, timeout: float = 60.0,
                          submit_timeout: float | None = None) -> AsyncReplyStream:
        request = self.engine.addressed(replace(request, stream=True))
        stream = AsyncReplyStream(self, request, timeout)
        loop = asyncio.get_running_loop()
        waker = self._wakers.get(loop)
        if waker is None:
            waker = self._wakers[loop] = LoopWaker(loop)
        push = stream.push
        self.engine.correlator.attach(request.request_id, lambda item: waker.push(push, item))
        try:
            await self.submit(request, timeout=timeout if submit_timeout is None else submit_timeout, wait_queued=0)
        except BaseException:
            stream.close()
            raise
        return stream

    def queued(self, request_id: str) -> Response | None:
        """The latest ``QUEUED`` event of a tracked request (see :meth:`LlmqClient.queued`)."""
        return self.engine.correlator.queued(request_id)

    def response_future(self, request_id: str) -> Future:
        """See :meth:`LlmqClient.response_future` (a concurrent future: wrap it to await it)."""
        return self.engine.expect(request_id)

    def forget(self, request_id: str) -> None:
        self.engine.forget(request_id)

    async def cancel(self, request_id: str, reason: str = "cancelled by the client", timeout: float = 30.0) -> None:
        fut = self.engine.cancel(request_id, reason)
        await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    async def result(self, request_id: str, timeout: float = 60.0) -> Response:
        """Wait for the terminal response to ``request_id`` (``QUEUED`` events are not one)."""
        fut = self.engine.expect(request_id)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            raise RequestTimeoutError(request_id, timeout) from None
        finally:
            self.engine.forget(request_id)

    async def submit_and_wait(self, request: Request, timeout: float = 60.0) -> Response:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self.submit(request, timeout, wait_queued=0)
        return await self.result(request.request_id, max(0.0, timeout - (loop.time() - started)))

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)

    async def __aenter__(self) -> "AsyncLlmqClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class _StreamStart:
    """What :meth:`AsyncLlmqClient.stream` returns: awaitable, or an async context manager."""

    def __init__(self, client: AsyncLlmqClient, request: Request, timeout: float):
        self._args = (client, request, timeout)
        self._stream: AsyncReplyStream | None = None

    def __await__(self):
        return self._args[0].open_stream(*self._args[1:]).__await__()

    async def __aenter__(self) -> AsyncReplyStream:
        self._stream = await self._args[0].open_stream(*self._args[1:])
        return self._stream

    async def __aexit__(self, *exc) -> None:
        if self._stream is not None:
            self._stream.close()


class AllResponses:
    """Every response on the response topic, all partitions, whoever it is for: for audit
    consumers (an ordinary client reads only its reply partitions). Needs READ on the whole
    topic. From the end at start (``from_beginning`` for the retained log)."""

    def __init__(self, settings: Settings | None = None, *, codec: Codec | None = None, from_beginning: bool = False):
        from confluent_kafka import OFFSET_BEGINNING

        self.settings = settings or Settings.load()
        self.codec = codec or codec_for(self.settings.serde)
        topic = self.settings.topics.responses
        self._consumer, errors = _reply_consumer(self.settings, "llmq-audit")
        try:
            tmd = _describe(self._consumer, self.settings, topic, errors)
            self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING if from_beginning
                                                  else _high_watermark(self._consumer, topic, p))
                                   for p in tmd.partitions])
        except BaseException:
            self._consumer.close()
            raise

    def poll(self, timeout: float = 1.0, max_messages: int = 500) -> list[Response]:
        out = []
        for msg in self._consumer.consume(max_messages, timeout):
            if msg.error() is not None or msg.value() is None:
                continue
            try:
                out.append(self.codec.decode_response(msg.value()))
            except DecodeError as exc:
                log.warning("undecodable response at %s[%d]@%d: %s", msg.topic(), msg.partition(), msg.offset(), exc)
        return out

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> AllResponses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
