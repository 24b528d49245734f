"""The client SDK for upstream services: submit requests, await their responses.

``LlmqClient`` (threads) and ``AsyncLlmqClient`` (asyncio) share one engine:

* ``submit`` encodes the request, routes it to its priority's topic keyed by tenant with
  an idempotent producer, and returns once the broker acknowledged it (or raises).
* ``result`` waits for the terminal response with that request_id. A listener thread
  reads the response topic from the positions it had *before* the first submit, so a fast
  answer is never missed; responses nobody waits for are dropped, and duplicates (possible
  after a worker crash) are ignored after the first.
* ``QUEUED`` events (sent before the answer to requests with ``notify_queued``) never
  resolve ``result``: ``queued(request_id)`` returns the latest one while it waits.

Example::

    with LlmqClient.from_settings() as client:
        response = client.submit_and_wait(Request.new("tenant-a", "Hello", priority=Priority.HIGH))
        print(response.status, response.output)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from pipeline.config import Settings
from pipeline.errors import AuthenticationError, DecodeError, KafkaOperationError, LlmqError, RequestTimeoutError
from pipeline.models import Request, Response
from pipeline.serde import Codec
from pipeline.serde.factory import codec_for

log = logging.getLogger(__name__)

_EARLY_RESPONSES = 1000
#: No response for this long while some are awaited: check the listener is not stuck.
_LISTENER_STALL_S = 10.0


@dataclass(frozen=True)
class Submitted:
    request_id: str
    topic: str
    partition: int
    offset: int


class _Correlator:
    """Matches responses to the futures waiting for them; no Kafka in here.

    A waiter's future resolves with the first *terminal* response to its request id.
    ``QUEUED`` events only replace the waiter's latest progress event; for requests
    nobody waits for they are dropped, so they cannot push answers out of the small
    buffer of early terminal responses kept for a late ``expect``.
    """

    def __init__(self, early_max: int = _EARLY_RESPONSES):
        self._waiters: dict[str, Future] = {}
        self._early: OrderedDict[str, Response] = OrderedDict()
        self._queued: dict[str, Response] = {}
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

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._waiters.pop(request_id, None)
            self._queued.pop(request_id, None)

    def queued(self, request_id: str) -> Response | None:
        with self._lock:
            return self._queued.get(request_id)

    def deliver(self, response: Response) -> None:
        request_id = response.request_id
        with self._lock:
            fut = self._waiters.get(request_id)
            if not response.status.is_terminal:
                if fut is not None and not fut.done():
                    self._queued[request_id] = response
                return
            if fut is None:
                # Not (yet) awaited: keep the newest few in case `result` is asked late.
                self._early[request_id] = response
                if len(self._early) > self._early_max:
                    self._early.popitem(last=False)
                return
            if not fut.done():
                self._queued.pop(request_id, None)
                fut.set_result(response)

    def waiting(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._waiters.values())

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(error)


class _Engine:
    def __init__(self, settings: Settings, codec: Codec | None = None, listen: bool = True):
        self.settings = settings
        self.codec = codec or codec_for(settings.serde)
        self.producer = Producer(settings.kafka.producer_config(**{"client.id": "llmq-client"}))
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll_producer, name="llmq-client-producer", daemon=True)
        self._poller.start()
        self.correlator = _Correlator()
        self._listener: threading.Thread | None = None
        self._listening = threading.Event()
        self._listener_error: BaseException | None = None
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

    def submit_future(self, request: Request) -> Future:
        topic = self.settings.topics.request_topic(request.priority)
        value = self.codec.encode_request(request, self.settings.serde.wire_format, topic)
        fut: Future = Future()

        def delivered(err, msg):
            if err is not None:
                fut.set_exception(KafkaOperationError(f"submit {request.request_id} to {topic}", err.str(), err))
            else:
                fut.set_result(Submitted(request.request_id, msg.topic(), msg.partition(), msg.offset()))

        while True:
            try:
                self.producer.produce(topic, value, request.tenant_id.encode(), on_delivery=delivered)
                break
            except BufferError:
                time.sleep(0.01)  # the poll thread drains the queue
        return fut

    def _poll_producer(self) -> None:
        while not self._closed.is_set():
            self.producer.poll(0.05)

    # -- responses ------------------------------------------------------------------------

    def expect(self, request_id: str) -> Future:
        """Register interest in a response; call before submitting to be race-free."""
        return self.correlator.expect(request_id)

    def forget(self, request_id: str) -> None:
        self.correlator.forget(request_id)

    def _start_listener(self) -> None:
        topic = self.settings.topics.responses
        client_errors: list = []
        consumer = Consumer(self.settings.kafka.consumer_config(
            "llmq-client-unused",  # assign() below: no group membership, no commits
            **{"client.id": "llmq-client-listener", "enable.partition.eof": False,
               "isolation.level": "read_committed", "fetch.wait.max.ms": 10,
               "error_cb": client_errors.append}))
        try:
            md = consumer.list_topics(topic, timeout=10)
        except KafkaException as exc:
            consumer.close()
            auth = [e for e in client_errors if e.code() == KafkaError._AUTHENTICATION]
            if auth:
                user = self.settings.kafka.sasl_username
                raise AuthenticationError(
                    "connect", f"the broker refused the credentials of {user!r} ({self.settings.kafka.sasl_mechanism}):"
                               f" {auth[-1].str()}", auth[-1]) from None
            raise KafkaOperationError(f"describe {topic}", str(exc.args[0]), exc.args[0]) from exc
        tmd = md.topics.get(topic)
        if tmd is not None and tmd.error is not None and tmd.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            consumer.close()
            raise KafkaOperationError(f"read responses from {topic}",
                                      f"not authorized (principal {self.settings.kafka.sasl_username or 'ANONYMOUS'} "
                                      "needs READ on it: see `llmq acls`)", tmd.error)
        if tmd is None or tmd.error is not None:
            consumer.close()
            raise LlmqError(f"response topic {topic!r} does not exist; run `llmq topics create`")
        # Explicit high watermarks, not OFFSET_END: END is resolved lazily at first fetch,
        # which could skip a response that arrives in between.
        assignment = []
        for p in tmd.partitions:
            assignment.append(TopicPartition(topic, p, self._high_watermark(consumer, topic, p)))
        consumer.assign(assignment)
        self._listener = threading.Thread(target=self._listen, args=(consumer,), name="llmq-client-listener",
                                          daemon=True)
        self._listener.start()

    @staticmethod
    def _high_watermark(consumer: Consumer, topic: str, partition: int, timeout: float = 30.0) -> int:
        # A partition without a leader yet (topic just created, broker restarting) fails
        # fast; retry rather than fall back to a lazily resolved end offset.
        deadline = time.monotonic() + timeout
        while True:
            try:
                return consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=5)[1]
            except KafkaException as exc:
                if time.monotonic() > deadline:
                    consumer.close()
                    raise KafkaOperationError(f"read end offset of {topic}[{partition}]", str(exc.args[0]),
                                              exc.args[0]) from exc
                time.sleep(0.2)

    def _listen(self, consumer: Consumer) -> None:
        last_message = last_check = time.monotonic()
        try:
            while not self._closed.is_set():
                # consume(n, timeout) waits for n messages or the timeout, whichever is
                # first; poll() returns at the first one, then take whatever else is ready.
                first = consumer.poll(0.1)
                if first is None:
                    now = time.monotonic()
                    if now - last_message > _LISTENER_STALL_S and now - last_check > _LISTENER_STALL_S:
                        last_check = now
                        self._unstick(consumer)
                    continue
                last_message = time.monotonic()
                for msg in [first, *consumer.consume(499, 0)]:
                    if msg.error() is not None or msg.value() is None:
                        continue
                    try:
                        response = self.codec.decode_response(msg.value())
                    except DecodeError as exc:
                        log.warning("undecodable response at %s[%d]@%d: %s", msg.topic(), msg.partition(),
                                    msg.offset(), exc)
                        continue
                    self.correlator.deliver(response)
        except BaseException as exc:  # surfaced to waiters instead of dying silently
            self._listener_error = exc
            self.correlator.fail_all(LlmqError(f"response listener failed: {exc}"))
        finally:
            consumer.close()

    def _unstick(self, consumer: Consumer) -> None:
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


class LlmqClient:
    """Synchronous client. Thread-safe; one per process is enough."""

    def __init__(self, settings: Settings | None = None, *, codec: Codec | None = None, listen: bool = True):
        self._engine = _Engine(settings or Settings.load(), codec, listen)

    @classmethod
    def from_settings(cls, path: str | None = None, **kwargs) -> "LlmqClient":
        return cls(Settings.load(path), **kwargs)

    def submit(self, request: Request, timeout: float = 30.0, track: bool = True) -> Submitted:
        """Produce ``request`` and return once the broker acknowledged it.

        With ``track`` (default) its response is kept for :meth:`result`; pass
        ``track=False`` for fire-and-forget submits so nothing is held for them.
        """
        if track:
            self._engine.expect(request.request_id)
        fut = self._engine.submit_future(request)
        try:
            return fut.result(timeout)
        except TimeoutError:
            raise KafkaOperationError(f"submit {request.request_id}", f"not acknowledged within {timeout}s") from None

    def submit_nowait(self, request: Request, track: bool = True) -> Future:
        """Produce without waiting; the future resolves to :class:`Submitted` on acknowledgement."""
        if track:
            self._engine.expect(request.request_id)
        return self._engine.submit_future(request)

    def cancel(self, request_id: str, reason: str = "cancelled by the client", timeout: float = 30.0) -> None:
        """Ask workers to answer ``request_id`` CANCELLED (best effort: a finished request stays finished)."""
        from pipeline.cancellations import cancellation_record

        key, value = cancellation_record(request_id, reason)
        fut: Future = Future()
        topic = self._engine.settings.topics.cancellations
        self._engine.producer.produce(
            topic, value, key,
            on_delivery=lambda err, msg: fut.set_exception(KafkaOperationError(f"cancel {request_id}", err.str(), err))
            if err is not None else fut.set_result(None))
        fut.result(timeout)

    def response_future(self, request_id: str) -> Future:
        """A future resolved with the terminal response to ``request_id`` (for callbacks, many at once).

        ``QUEUED`` events never resolve it (see :meth:`queued`). Register it before
        submitting; call :meth:`result` or :meth:`forget` when done.
        """
        return self._engine.expect(request_id)

    def queued(self, request_id: str) -> Response | None:
        """The latest ``QUEUED`` event (``queue_position``, ``eta_ms``) of a tracked request.

        ``None`` until one arrives (the gateway sends them only to requests with
        ``notify_queued``), and again once the terminal response has arrived or the
        request is forgotten. Poll it while :meth:`result` waits in another thread.
        """
        return self._engine.correlator.queued(request_id)

    def forget(self, request_id: str) -> None:
        """Stop holding the response to ``request_id``."""
        self._engine.forget(request_id)

    def result(self, request_id: str, timeout: float = 60.0) -> Response:
        """Wait for the terminal response to ``request_id`` (``QUEUED`` events are not one)."""
        fut = self._engine.expect(request_id)
        try:
            return fut.result(timeout)
        except TimeoutError:
            raise RequestTimeoutError(request_id, timeout) from None
        finally:
            self._engine.forget(request_id)

    def submit_and_wait(self, request: Request, timeout: float = 60.0) -> Response:
        started = time.monotonic()
        self.submit(request, timeout=timeout)
        return self.result(request.request_id, max(0.0, timeout - (time.monotonic() - started)))

    def close(self) -> None:
        self._engine.close()

    def __enter__(self) -> "LlmqClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncLlmqClient:
    """asyncio client: the same engine, awaited."""

    def __init__(self, settings: Settings | None = None, *, codec: Codec | None = None):
        self._engine = _Engine(settings or Settings.load(), codec, listen=True)

    async def submit(self, request: Request, timeout: float = 30.0, track: bool = True) -> Submitted:
        if track:
            self._engine.expect(request.request_id)
        fut = self._engine.submit_future(request)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            raise KafkaOperationError(f"submit {request.request_id}", f"not acknowledged within {timeout}s") from None

    def queued(self, request_id: str) -> Response | None:
        """The latest ``QUEUED`` event of a tracked request (see :meth:`LlmqClient.queued`)."""
        return self._engine.correlator.queued(request_id)

    async def result(self, request_id: str, timeout: float = 60.0) -> Response:
        """Wait for the terminal response to ``request_id`` (``QUEUED`` events are not one)."""
        fut = self._engine.expect(request_id)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            raise RequestTimeoutError(request_id, timeout) from None
        finally:
            self._engine.forget(request_id)

    async def submit_and_wait(self, request: Request, timeout: float = 60.0) -> Response:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self.submit(request, timeout)
        return await self.result(request.request_id, max(0.0, timeout - (loop.time() - started)))

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._engine.close)

    async def __aenter__(self) -> "AsyncLlmqClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
