"""What the gateway publishes (dispatches, answers, dead letters), and when a request is done.

Outputs go through librdkafka (confluent-kafka's ``Producer``): a produce only queues the record
for librdkafka's own threads, where aiokafka's producer batches and encodes on the event loop,
the one the agents decide requests on.
The gateway's agents do not let Faust acknowledge a request when they move on (their streams are
``noack()``); a request is acknowledged (``event.ack()``) only when

* the broker has acknowledged every output it caused, and
* the tenant state it changed has been handed to Faust's table (at the next state flush; Faust
  flushes its own producer, the changelogs', before it commits an offset).

Faust commits only contiguously acknowledged offsets, so a crash can redo a request, never skip
one. An output the broker refuses after librdkafka's retries stops the gateway: the restart
admits again from the last commit, which is before it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import Callable, NamedTuple

from confluent_kafka import KafkaException, Producer

log = logging.getLogger(__name__)


class Output(NamedTuple):
    """One record a decision publishes: a dispatch, an answer or a dead letter."""

    topic: str
    value: bytes
    key: bytes | None
    headers: list[tuple[str, bytes]] | None = None
    #: None: the producer's partitioner chooses by the key (the tenant), as for every record the
    #: gateway writes but an answer to a client that reads one partition of the responses.
    partition: int | None = None


class Done:
    """One request's countdown to its acknowledgement: its outputs, plus the state flush."""

    __slots__ = ("event", "left")

    def __init__(self, event, outputs: int):
        self.event = event
        self.left = outputs + 1

    def one(self) -> None:
        self.left -= 1
        if self.left == 0 and self.event is not None:
            self.event.ack()


class Outputs:
    """One librdkafka producer, its delivery reports served by a thread of their own and
    handed to the event loop."""

    def __init__(self, config: dict, on_failure: Callable[[str], None], poll_s: float = 0.05):
        self.producer = Producer(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_failure = on_failure
        self.failed: list[str] = []
        #: Outputs the broker acknowledged so far (the progress watch's measure of this producer).
        self.delivered_total = 0
        # Delivered outputs, handed to the event loop once per poll: waking the loop for each
        # one costs it a system call per output.
        self._delivered: deque[Done] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(poll_s,), name="llmq-gateway-deliveries",
                                        daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread.start()

    def send(self, output: Output, done: Done) -> None:
        """Produce ``output``; ``done`` counts it delivered when the broker acknowledges it."""
        def delivered(err, msg) -> None:  # on the delivery thread, inside poll()
            if err is None:
                self.delivered_total += 1
                self._delivered.append(done)
            else:
                self._call(self._refused, f"{msg.topic()}: {err.str()}")

        while True:
            try:
                if output.partition is None:
                    self.producer.produce(output.topic, output.value, output.key, headers=output.headers,
                                          on_delivery=delivered)
                else:
                    self.producer.produce(output.topic, output.value, output.key, partition=output.partition,
                                          headers=output.headers, on_delivery=delivered)
                return
            except BufferError:
                # librdkafka's queue is full: the delivery thread frees room within a poll.
                self.producer.poll(0.01)
            except KafkaException as exc:
                self._refused(f"{output.topic}: {exc.args[0].str()}")
                return

    def _refused(self, what: str) -> None:
        self.failed.append(what)
        self.on_failure(what)

    def _serve(self, poll_s: float) -> None:
        while not self._stop.is_set():
            self.producer.poll(poll_s)
            if self._delivered:
                self._call(self._acknowledge)

    def _acknowledge(self) -> None:  # on the event loop
        delivered = self._delivered
        while delivered:
            delivered.popleft().one()

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the process is going, uncommitted work is redone
            pass

    def close(self, timeout_s: float = 30.0) -> int:
        """Deliver what is queued (acknowledging it), then stop; returns what was left undelivered."""
        left = self.producer.flush(timeout_s)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._acknowledge()
        if left:
            log.error("%d gateway outputs were not delivered at shutdown; their requests are admitted again "
                      "after the restart", left)
        return left
