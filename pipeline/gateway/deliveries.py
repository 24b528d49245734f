"""Acknowledge a gateway batch's source records once the broker has every output of the batch.

The gateway's outputs (dispatched requests, rejections, dead letters, table changelogs) go
through librdkafka. Waiting for a batch's deliveries before taking the next batch left the event
loop idle for a broker round trip per batch. Instead the next batch goes ahead, and a thread
that polls the producer acknowledges a batch's records (in the event loop) when the last output
of the batch is delivered. Faust commits only contiguously acknowledged offsets, and before a
rebalance or a shutdown it waits until every batch handed out is acknowledged, so an offset
is never committed ahead of an output.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from confluent_kafka import Producer

log = logging.getLogger(__name__)

_produce_all = None


class Deliveries:
    """The producers' delivery reports, served from one thread, and the batches waiting on them.

    ``producer`` sends what is urgent; ``bulk`` (if given, else ``producer``) what may wait
    longer to be sent together (a longer ``linger.ms``: fewer produce requests)."""

    def __init__(self, producer: Producer, poll_s: float = 0.05, bulk: Producer | None = None,
                 on_failure=None):
        self.producer = producer
        self.bulk = bulk or producer
        self.producers = [producer] if self.bulk is producer else [producer, self.bulk]
        self.poll_s = poll_s
        self.failed: list[str] = []  # "topic: error" of outputs the broker refused
        #: Called in the event loop, once, when the first output is refused: its batch can never
        #: be acknowledged, so nothing after it would be committed either, whether more
        #: batches come or not.
        self.on_failure = on_failure
        self.failure_reported = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None  # acknowledgements are made on the loop's thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def batch(self) -> "Outputs":
        """A new batch's outputs (called from the event loop: its events are acknowledged there)."""
        if self._thread is None:
            self.loop = asyncio.get_running_loop()
            self.loop_thread = threading.get_ident()
            self._thread = threading.Thread(target=self._serve, name="gateway-deliveries", daemon=True)
            self._thread.start()
        return Outputs(self)

    def _serve(self) -> None:
        producers = self.producers
        wait = self.poll_s / len(producers)
        while not self._stop.is_set():
            for p in producers:
                p.poll(wait)

    def close(self, timeout: float = 30.0) -> int:
        """Deliver what is queued (reports included), stop the thread; returns what is still queued."""
        remaining = sum(p.flush(timeout) for p in self.producers)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if remaining:
            log.error("%d gateway outputs not delivered at shutdown: their requests will be admitted again",
                      remaining)
        return remaining


class Outputs:
    """What one batch produced: its records are acknowledged when all of it is delivered."""

    __slots__ = ("deliveries", "produced", "delivered", "on_done", "sealed", "lock")

    def __init__(self, deliveries: Deliveries):
        self.deliveries = deliveries
        self.produced = 0
        self.delivered = 0
        self.on_done = None
        self.sealed = False
        self.lock = threading.Lock()

    def produce(self, topic: str, value: bytes, key: bytes | None, headers=None, partition: int | None = None,
                bulk: bool = False) -> None:
        """Queue one output (``bulk``: through the producer that waits longer to batch)."""
        producer = self.deliveries.bulk if bulk else self.deliveries.producer
        try:
            if partition is None:
                producer.produce(topic, value, key, headers=headers, on_delivery=self._on_delivery)
            else:
                producer.produce(topic, value, key, partition=partition, headers=headers, on_delivery=self._on_delivery)
        except BufferError:
            self._produce_when_room(producer, topic, value, key, headers, partition)
        # Counted once queued: an output the producer refuses outright is never delivered, and
        # counted it would hold back the batch's acknowledgement for ever.
        self.produced += 1

    def produce_many(self, topic: str, values: list, keys: list, bulk: bool = False, on_error=None) -> None:
        """Queue ``values`` (with their ``keys``) to ``topic`` in order, as :meth:`produce` would one
        by one; ``on_error(j, exc)`` is told of each one the producer refuses (not for want of
        room: those wait for it), and the others go on."""
        producer = self.deliveries.bulk if bulk else self.deliveries.producer
        on_delivery = self._on_delivery
        start, n = 0, len(values)
        while start < n:
            if _produce_all is not None:  # a C loop: stops at the first produce() that raises
                done = _produce_all(producer.produce, topic, values[start:] if start else values,
                                    keys[start:] if start else keys, on_delivery, Exception)
                self.produced += done
                start += done
                if start >= n:
                    return
            try:  # this one the careful way
                self.produce(topic, values[start], keys[start], bulk=bulk)
            except Exception as exc:  # noqa: BLE001 (the caller answers for it; the rest go on)
                if on_error is None:
                    raise
                on_error(start, exc)
            start += 1

    def _produce_when_room(self, producer: Producer, topic, value, key, headers, partition) -> None:
        """The producer's local queue is full: serve deliveries until it has room for this one."""
        extra = {} if partition is None else {"partition": partition}
        while True:
            producer.poll(0.05)
            try:
                producer.produce(topic, value, key, headers=headers, on_delivery=self._on_delivery, **extra)
                return
            except BufferError:
                pass

    def seal(self, on_done) -> None:
        """No more outputs: call ``on_done()`` in the event loop once the outputs are delivered."""
        with self.lock:
            self.on_done = on_done
            self.sealed = True
            done = self.delivered == self.produced
        if done:
            self._release()

    def _on_delivery(self, err, msg) -> None:
        if err is not None:
            # Never released: the batch's offsets are not committed, and the gateway stops.
            deliveries = self.deliveries
            deliveries.failed.append(f"{msg.topic()}: {err}")
            # Reports come from the delivery thread, or from the loop's thread while a full queue
            # is polled: both may see the first failure, none may miss it (on_failure copes with two).
            reported, deliveries.failure_reported = deliveries.failure_reported, True
            if not reported and deliveries.on_failure is not None:
                if threading.get_ident() == deliveries.loop_thread:
                    deliveries.on_failure()
                else:
                    try:
                        deliveries.loop.call_soon_threadsafe(deliveries.on_failure)
                    except RuntimeError:  # the loop is closed: shutting down, close() reports it
                        log.error("gateway output not delivered after the event loop closed: %s",
                                  deliveries.failed[-1])
            return
        with self.lock:
            self.delivered += 1
            done = self.sealed and self.delivered == self.produced
        if done:
            self._release()

    def _release(self) -> None:
        if threading.get_ident() == self.deliveries.loop_thread:
            self.on_done()
        else:
            self.deliveries.loop.call_soon_threadsafe(self.on_done)
