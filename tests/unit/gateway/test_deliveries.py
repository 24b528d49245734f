"""A gateway batch's records are acknowledged only once every output of the batch is delivered
(pipeline.gateway.deliveries)."""

import asyncio
import threading

from pipeline.gateway.deliveries import Deliveries


class HeldProducer:
    """Keeps each produce's delivery callback until the test delivers it; poll() does nothing."""

    def __init__(self):
        self.pending = []
        self.lock = threading.Lock()

    def produce(self, topic, value, key, headers=None, on_delivery=None, partition=None):
        with self.lock:
            self.pending.append((topic, on_delivery))

    def poll(self, timeout):
        threading.Event().wait(min(timeout, 0.01))
        return 0

    def flush(self, timeout):
        self.deliver_all()
        return 0

    def deliver_all(self, error=None):
        with self.lock:
            pending, self.pending = self.pending, []
        for topic, callback in pending:
            callback(error, _Msg(topic))


class _Msg:
    def __init__(self, topic):
        self._topic = topic

    def topic(self):
        return self._topic


def acks(names, acked):
    """What the gateway seals a batch with: acknowledging the batch's records (here: names)."""
    return lambda: acked.extend(names)


def _run(body, producer=None):
    async def main():
        nonlocal producer
        producer = producer or HeldProducer()
        deliveries = Deliveries(producer, poll_s=0.01)
        try:
            await body(producer, deliveries)
        finally:
            deliveries.close(1)

    asyncio.run(main())


def test_records_are_acknowledged_after_the_last_output_of_their_batch_is_delivered():
    async def body(producer, deliveries):
        acked = []
        outputs = deliveries.batch()
        outputs.produce("dispatch", b"v", b"k")
        outputs.produce("changelog", b"v", b"k", partition=3)
        outputs.seal(acks(["e1", "e2"], acked))
        await asyncio.sleep(0.02)
        assert acked == []
        # delivered from another thread, as librdkafka's delivery reports are
        threading.Thread(target=producer.deliver_all).start()
        for _ in range(100):
            if acked:
                break
            await asyncio.sleep(0.01)
        assert acked == ["e1", "e2"]

    _run(body)


def test_a_batch_without_outputs_is_acknowledged_at_once():
    async def body(producer, deliveries):
        acked = []
        deliveries.batch().seal(acks(["e"], acked))
        assert acked == ["e"]

    _run(body)


def test_outputs_delivered_before_the_batch_is_sealed_still_count():
    async def body(producer, deliveries):
        acked = []
        outputs = deliveries.batch()
        outputs.produce("dispatch", b"v", b"k")
        producer.deliver_all()
        assert acked == []
        outputs.seal(acks(["e"], acked))
        assert acked == ["e"]

    _run(body)


def test_a_refused_output_keeps_its_batch_unacknowledged_and_is_reported():
    async def body(producer, deliveries):
        acked = []
        outputs = deliveries.batch()
        outputs.produce("dispatch", b"v", b"k")
        outputs.seal(acks(["e"], acked))
        producer.deliver_all(error="MSG_TIMED_OUT")
        await asyncio.sleep(0.02)
        assert acked == [] and deliveries.failed == ["dispatch: MSG_TIMED_OUT"]

    _run(body)


def test_the_first_refused_output_is_reported_in_the_event_loop_without_another_batch():
    # Its batch is never acknowledged, so nothing after it is committed either: the gateway
    # must stop and be restarted even if no request ever comes again.
    async def main():
        producer = HeldProducer()
        reports = []
        loop_thread = threading.get_ident()
        deliveries = Deliveries(producer, poll_s=0.01,
                                on_failure=lambda: reports.append(threading.get_ident() == loop_thread))
        try:
            outputs = deliveries.batch()
            outputs.produce("dispatch", b"v", b"k")
            outputs.produce("dispatch", b"v", b"k")
            outputs.seal(lambda: None)
            threading.Thread(target=producer.deliver_all, kwargs={"error": "MSG_TIMED_OUT"}).start()
            for _ in range(100):
                if reports:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert reports == [True] and len(deliveries.failed) == 2
        finally:
            deliveries.close(1)

    asyncio.run(main())


def test_bulk_outputs_go_through_the_bulk_producer_and_the_batch_waits_for_both():
    async def main():
        urgent, bulk = HeldProducer(), HeldProducer()
        deliveries = Deliveries(urgent, poll_s=0.01, bulk=bulk)
        try:
            acked = []
            outputs = deliveries.batch()
            outputs.produce("dispatch.critical", b"v", b"k")
            outputs.produce("dispatch.background", b"v", b"k", bulk=True)
            outputs.produce("changelog", b"v", b"k", partition=1, bulk=True)
            outputs.seal(acks(["e"], acked))
            assert [t for t, _ in urgent.pending] == ["dispatch.critical"]
            assert [t for t, _ in bulk.pending] == ["dispatch.background", "changelog"]
            urgent.deliver_all()
            await asyncio.sleep(0.02)
            assert acked == []
            bulk.deliver_all()
            await asyncio.sleep(0.02)
            assert acked == ["e"]
        finally:
            assert deliveries.close(1) == 0

    asyncio.run(main())


def test_a_refusal_reported_after_the_event_loop_closed_is_logged_not_raised(caplog):
    producer = HeldProducer()
    deliveries = Deliveries(producer, poll_s=0.01, on_failure=lambda: None)

    async def one_output():
        deliveries.batch().produce("dispatch", b"v", b"k")

    asyncio.run(one_output())  # closes its loop, as a stopped gateway's is
    raised = []

    def report():
        try:
            producer.deliver_all(error="_PURGE_QUEUE")
        except Exception as exc:  # noqa: BLE001
            raised.append(exc)

    reporter = threading.Thread(target=report)
    reporter.start()
    reporter.join(5)
    deliveries.close(1)
    assert raised == [] and deliveries.failed == ["dispatch: _PURGE_QUEUE"]
    assert "after the event loop closed" in caplog.text


class FullQueueProducer(HeldProducer):
    """Refuses every produce while ``full`` (librdkafka's local queue limit); poll() delivers
    what is held and frees the queue."""

    def __init__(self, full_for: int):
        super().__init__()
        self.full_for = full_for
        self.produced = []

    def produce(self, topic, value, key, headers=None, on_delivery=None, partition=None):
        if self.full_for:
            raise BufferError("Local: Queue full")
        self.produced.append((topic, value, key, partition))
        super().produce(topic, value, key, headers, on_delivery, partition)

    def poll(self, timeout):
        self.deliver_all()
        self.full_for = max(0, self.full_for - 1)
        return 0


def test_an_output_refused_by_a_full_local_queue_is_queued_once_there_is_room_and_still_counted():
    async def body(producer, deliveries):
        acked = []
        outputs = deliveries.batch()
        outputs.produce("changelog", b"v", b"k", partition=3)  # waits until a poll makes room
        outputs.produce("dispatch", b"w", b"t")
        assert producer.produced == [("changelog", b"v", b"k", 3), ("dispatch", b"w", b"t", None)]
        outputs.seal(acks(["e1"], acked))
        producer.deliver_all()
        for _ in range(100):
            if acked:
                break
            await asyncio.sleep(0.01)
        assert acked == ["e1"]

    _run(body, FullQueueProducer(full_for=3))
