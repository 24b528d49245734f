"""The health judgement: stalls, backpressure, recovery then exit, reasons named."""

from __future__ import annotations

from pipeline.observability.health import Health, PartitionProgress, Pending


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_records_waiting_and_nothing_consumed_for_stall_s_is_a_stall():
    clock = Clock()
    p = PartitionProgress(10.0, clock=clock)
    p.assigned([("req", 0), ("req", 1)])
    p.waiting(("req", 0), 5)
    p.waiting(("req", 1), 0)
    clock.now += 9.9
    assert p.stalls() == [] and p.reason() is None
    clock.now += 0.2
    [stall] = p.stalls()
    assert stall.key == ("req", 0) and stall.waiting == 5 and stall.seconds >= 10
    assert "req" in p.reason() and "5 waiting" in p.reason()


def test_consuming_is_progress_and_an_idle_partition_starts_its_wait_when_records_arrive():
    clock = Clock()
    p = PartitionProgress(10.0, clock=clock)
    p.assigned(["a"])
    p.consumed("a")
    clock.now += 3600  # idle for an hour: nothing waited
    p.waiting("a", 3)
    clock.now += 5
    assert p.stalls() == []
    for _ in range(10):  # a backlog being consumed is no stall however long it lasts
        clock.now += 5
        p.consumed("a")
        p.waiting("a", 1000)
    assert p.stalls() == []


def test_backpressure_is_not_a_stall():
    clock = Clock()
    p = PartitionProgress(10.0, clock=clock)
    p.assigned(["a"])
    for _ in range(10):
        clock.now += 5
        p.waiting("a", 500, held=True)  # paused: the queues are full on purpose
    assert p.stalls() == []
    p.waiting("a", 500)  # resumed: a fresh wait starts now
    clock.now += 5
    assert p.stalls() == []
    clock.now += 5
    assert [s.key for s in p.stalls()] == ["a"]


def test_a_stall_is_recovered_once_then_given_up():
    clock = Clock()
    p = PartitionProgress(10.0, recoveries=1, clock=clock)
    p.assigned(["a"])
    p.waiting("a", 2)
    clock.now += 10
    assert [s.key for s in p.to_recover()] == ["a"] and p.given_up() == []
    assert p.to_recover() == []  # once
    assert p.stalls() == []  # the recovery's chance: another stall_s
    clock.now += 10
    assert p.to_recover() == []
    assert [s.key for s in p.given_up()] == ["a"]


def test_a_recovery_that_works_resets_the_count():
    clock = Clock()
    p = PartitionProgress(10.0, recoveries=1, clock=clock)
    p.assigned(["a"])
    p.waiting("a", 2)
    clock.now += 10
    assert p.to_recover()
    clock.now += 1
    p.consumed("a")
    clock.now += 20  # stalled again later: a new stall, recovered first again
    assert [s.key for s in p.to_recover()] == ["a"] and p.given_up() == []


def test_revoked_partitions_are_forgotten():
    clock = Clock()
    p = PartitionProgress(1.0, clock=clock)
    p.assigned(["a", "b"])
    p.waiting("a", 1)
    p.assigned(["b"])
    clock.now += 5
    p.waiting("a", 1)  # no longer ours: ignored
    assert p.stalls() == [] and p.partitions == {"b"}


def test_pending_producer_records_past_their_timeout():
    clock = Clock()
    w = Pending(60.0, "responses", clock=clock)
    w.observe(10, 0)
    clock.now += 30
    w.observe(10, 5)  # deliveries: progress
    clock.now += 59
    w.observe(12, 5)
    assert w.reason() is None
    clock.now += 2
    assert "responses outstanding" in w.reason()
    w.observe(0, 5)
    assert w.reason() is None


def test_an_open_transaction_past_its_timeout():
    assert Pending.oldest([0.0, 50.0], 60.0, "a transaction", now=55.0) is None
    assert "open for 61 s" in Pending.oldest([0.0, 50.0], 60.0, "a transaction", now=61.0)


def test_health_names_each_failing_check_and_ready_includes_live():
    h = Health()
    h.add_live("progress", lambda: "stalled: req[0]")
    h.add_live("fine", lambda: None)
    h.add_ready("assignment", lambda: "no partitions assigned")

    def broken():
        raise RuntimeError("/secret/path")

    h.add_ready("broken", broken)
    code, doc = h.answer("live")
    assert code == 503 and doc == {"status": "not live", "reasons": ["progress: stalled: req[0]"]}
    code, doc = h.answer("ready")
    assert code == 503 and doc["reasons"] == ["progress: stalled: req[0]", "assignment: no partitions assigned",
                                              "broken: check failed (RuntimeError)"]
    assert "secret" not in str(doc)


def test_health_ok():
    h = Health()
    h.add_live("progress", lambda: None)
    h.add_ready("started", lambda: None)
    assert h.answer("live") == (200, {"status": "ok", "checks": ["progress"]})
    assert h.answer("ready") == (200, {"status": "ok", "checks": ["progress", "started"]})
