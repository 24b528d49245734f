"""The gateway's topics come from faust's consumer in batches (pipeline.gateway.intake and the
consumer's fetch loop in pipeline.gateway.faust_fixes), and their offsets are acknowledged
through faust's own bookkeeping: what faust commits and waits for stays what it would be."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import faust
from faust.types import TP

from pipeline.gateway import faust_fixes
from pipeline.gateway.intake import Acks, BatchIntake


def _record(topic, partition, offset):
    """The attributes of aiokafka's ConsumerRecord."""
    return SimpleNamespace(topic=topic, partition=partition, offset=offset, key=b"k", value=b"v", headers=[],
                           timestamp=0, timestamp_type=0, checksum=None, serialized_key_size=1,
                           serialized_value_size=1)


def _consumer(handlers, max_batch=100):
    faust_fixes.apply()
    app = faust.App(f"intake-test-{id(handlers)}", broker="kafka+llmq://127.0.0.1:1", store="memory://")
    for name in handlers:
        app.topics.add(app.topic(name))
        app.topics._acking_topics.add(name)  # what faust's subscription does for these topics
    app.llmq_intake = BatchIntake(handlers, max_batch)
    consumer = app.consumer
    assert isinstance(consumer, faust_fixes._ShortFetchConsumer)
    consumer.highwater = lambda tp: 0  # no broker here
    return app, consumer


def _fetch(consumer, app, records):
    asyncio.run(consumer._deliver_fetched(app.llmq_intake, records, None))


def test_topics_are_served_in_the_registered_order_in_batches_of_at_most_max_batch():
    calls = []
    handlers = {name: (lambda name: lambda recs, acks: calls.append((name, [r.offset for r in recs])))(name)
                for name in ("critical", "background", "responses")}
    app, consumer = _consumer(handlers, max_batch=3)
    bg0, bg1, crit = TP("background", 0), TP("background", 1), TP("critical", 2)
    _fetch(consumer, app, {
        bg0: [_record("background", 0, o) for o in range(4)],
        bg1: [_record("background", 1, o) for o in (10, 11)],
        crit: [_record("critical", 2, 7)],
    })
    assert calls == [("critical", [7]), ("background", [0, 1, 2]), ("background", [3, 10, 11])]
    assert consumer._read_offset[bg0] == 3 and consumer._read_offset[bg1] == 11


def test_offsets_are_acknowledged_when_the_handler_says_so_and_not_before():
    held = []
    app, consumer = _consumer({"requests": lambda recs, acks: held.append(acks)})
    tp = TP("requests", 0)
    _fetch(consumer, app, {tp: [_record("requests", 0, o) for o in (5, 6, 7)]})
    [acks] = held
    assert consumer._acked[tp] == [] and acks in consumer._unacked_messages  # faust waits for it
    acks.ack()
    assert consumer._acked[tp] == [5, 6, 7] and consumer._acked_index[tp] == {5, 6, 7}
    assert consumer._n_acked == 3 and acks not in consumer._unacked_messages
    acks.ack()  # once only
    assert consumer._acked[tp] == [5, 6, 7] and consumer._n_acked == 3


def test_offsets_below_the_committed_offset_are_not_acknowledged_again():
    app, consumer = _consumer({"requests": lambda recs, acks: None})
    tp = TP("requests", 0)
    consumer._committed_offset[tp] = 6
    acks = Acks(consumer)
    acks.offsets[tp] = [4, 5, 6, 7]
    acks.ack()
    assert consumer._acked[tp] == [6, 7]


def test_records_before_the_read_offset_are_not_handed_over_twice():
    got = []
    app, consumer = _consumer({"requests": lambda recs, acks: got.extend(r.offset for r in recs)})
    tp = TP("requests", 0)
    consumer._read_offset[tp] = 3
    _fetch(consumer, app, {tp: [_record("requests", 0, o) for o in (2, 3, 4)]})
    assert got == [3, 4]  # as faust: the read offset itself may come again, what is before it not


def test_a_rebalance_during_a_fetch_leaves_the_rest_unread_for_after_the_seek():
    got = []
    app, consumer = _consumer({"requests": lambda recs, acks: (got.append([r.offset for r in recs]),
                                                               setattr(consumer, "flow_active", False))},
                              max_batch=2)
    tp = TP("requests", 0)
    _fetch(consumer, app, {tp: [_record("requests", 0, o) for o in range(5)]})
    assert got == [[0, 1]]
    assert consumer._read_offset[tp] == 1  # offsets 2.. were not read


def test_other_topics_take_fausts_own_path_one_message_at_a_time():
    delivered = []
    app, consumer = _consumer({"requests": lambda recs, acks: None})

    async def callback(message):
        delivered.append((message.topic, message.offset))

    consumer.callback = callback
    tp = TP("gw-admitted-changelog", 0)
    _fetch(consumer, app, {tp: [_record(tp.topic, 0, o) for o in (0, 1)]})
    assert delivered == [(tp.topic, 0), (tp.topic, 1)]


def test_after_a_fetch_with_records_the_next_gathers_and_after_an_empty_one_it_returns_at_once():
    class Fetcher:
        _fetch_max_wait_ms, _fetch_min_bytes = 100, 1

        def __init__(self):
            self.results = []

        async def _proc_fetch_request(self, assignment, node_id, request):
            return self.results.pop(0)

    fetcher = Fetcher()
    faust_fixes.adapt_fetch_waits(fetcher, idle_wait_ms=100, busy_wait_ms=10, busy_min_bytes=1 << 20)

    async def fetch(has_data):
        fetcher.results.append(has_data)
        return await fetcher._proc_fetch_request(None, 1, None)

    assert asyncio.run(fetch(True)) is True
    assert (fetcher._fetch_max_wait_ms, fetcher._fetch_min_bytes) == (10, 1 << 20)
    assert asyncio.run(fetch(False)) is False
    assert (fetcher._fetch_max_wait_ms, fetcher._fetch_min_bytes) == (100, 1)


def test_records_of_an_urgent_band_make_fetches_answer_at_once_for_a_while():
    class Fetcher:
        _fetch_max_wait_ms, _fetch_min_bytes = 100, 1

        def __init__(self):
            self._records = {}
            self.results = []

        async def _proc_fetch_request(self, assignment, node_id, request):
            fetched = self.results.pop(0)
            self._records.clear()
            self._records.update({TP(topic, 0): [] for topic in fetched})
            return bool(fetched)

    fetcher = Fetcher()
    faust_fixes.adapt_fetch_waits(fetcher, idle_wait_ms=100, busy_wait_ms=10, busy_min_bytes=1 << 20,
                                  prompt_topics=frozenset({"req.critical"}), prompt_hold_s=0.2)

    def fetch(*topics):
        fetcher.results.append(list(topics))
        asyncio.run(fetcher._proc_fetch_request(None, 1, None))
        return fetcher._fetch_max_wait_ms, fetcher._fetch_min_bytes

    assert fetch("req.background") == (10, 1 << 20)  # bulk only: gather
    assert fetch("req.background", "req.critical") == (100, 1)  # an urgent record: answer at once
    assert fetch("req.background") == (100, 1)  # ... for a while after it
    time.sleep(0.25)
    assert fetch("req.background") == (10, 1 << 20)  # then gather again
