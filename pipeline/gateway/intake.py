"""Fetched records to the gateway in batches, instead of one faust event at a time.

faust hands every fetched message to its agents as an event: a ``ConsumerMessage``, the
conductor's callback, a channel queue, the stream iterator, an acknowledgement, each with its
own coroutine frames. Over a backlog that was ~40 % of the gateway's event loop, as much as the
admission itself, and the loop is what limits the gateway. For the topics the gateway
registers (the request topics and the response topic), the consumer's fetch loop
(``_drain_messages`` in :mod:`pipeline.gateway.faust_fixes`) hands each fetch's records to a
handler instead, a topic at a time in the registered order (CRITICAL first) and at most
``max_batch`` records per call.

The handler acknowledges the offsets of a batch through faust's own bookkeeping
(:meth:`Acks.ack`) once the batch's outputs are delivered. faust still commits only
contiguously acknowledged offsets, and before a rebalance or a shutdown it still waits for the
batches in flight (each is one entry of the consumer's unacknowledged set). Every other
topic (the tables' changelogs during recovery) takes faust's path unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from faust.types.tuples import ack_lock
from mode.utils.futures import notify


class Acks:
    """The offsets of one handled batch; acknowledged together, on the event loop's thread."""

    __slots__ = ("consumer", "offsets", "acked", "__weakref__")

    def __init__(self, consumer):
        self.consumer = consumer
        self.offsets: dict = {}  # TP → [offset, ...]
        self.acked = False

    @property
    def refcount(self) -> int:  # what faust logs of what it waits for
        return 0 if self.acked else 1

    def ack(self) -> None:
        if self.acked:
            return
        self.acked = True
        c = self.consumer
        with ack_lock:  # as faust's Consumer.ack: the shared indexes change in one step
            n = 0
            for tp, offsets in self.offsets.items():
                committed = c._committed_offset[tp]
                index, acked = c._acked_index[tp], c._acked[tp]
                for offset in offsets:
                    if (committed is None or offset >= committed) and offset not in index:
                        index.add(offset)
                        acked.append(offset)
                        n += 1
            c._n_acked += n
        c._unacked_messages.discard(self)
        notify(c._waiting_for_ack)


class BatchIntake:
    """The topics read in batches, in the order they are served, and their handlers.

    ``handlers[topic](records, acks)`` is synchronous; ``records`` are aiokafka
    ``ConsumerRecord``s (of one topic, possibly several partitions, each partition's in offset
    order), and the handler calls ``acks.ack()`` when it is done with them, now or later.
    """

    def __init__(self, handlers: dict[str, Callable[[Sequence, Acks], None]], max_batch: int):
        self.handlers = dict(handlers)
        self.rank = {topic: i for i, topic in enumerate(self.handlers)}
        self.max_batch = max(1, max_batch)
