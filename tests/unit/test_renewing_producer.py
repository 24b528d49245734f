"""A producer that stops delivering is replaced; its records still end, on the old client."""

from __future__ import annotations

from pipeline.renewing_producer import RenewingProducer


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class FakeProducer:
    """Holds records until told to deliver them (or fail them); ``stuck`` ones never go."""

    made: list["FakeProducer"] = []

    def __init__(self, config):
        self.pending: list = []
        FakeProducer.made.append(self)

    def produce(self, topic, value=None, key=None, on_delivery=None, **kwargs):
        self.pending.append((value, on_delivery))

    def deliver(self, err=None):
        for value, cb in self.pending:
            cb(err, value)
        self.pending = []

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=-1):
        return len(self.pending)

    def __len__(self):
        return len(self.pending)


def make(stall_s=30.0):
    FakeProducer.made = []
    clock = Clock()
    return RenewingProducer({}, stall_s, clock, FakeProducer), clock


def test_a_producer_that_delivers_is_kept_however_long_between_records():
    p, clock = make()
    for _ in range(5):
        p.produce("t", b"x")
        clock.now += 20
        p.current.deliver()
        p.poll()
        clock.now += 100
    assert p.renewals == 0 and len(FakeProducer.made) == 1


def test_records_outstanding_with_no_delivery_for_the_stall_period_move_new_ones_to_a_new_producer():
    p, clock = make()
    results = []
    p.produce("t", b"old", on_delivery=lambda err, msg: results.append((err, msg)))
    stuck = p.current
    clock.now += 29
    p.poll()
    assert p.renewals == 0
    clock.now += 2
    p.poll()
    assert p.renewals == 1 and p.current is not stuck
    p.produce("t", b"new", on_delivery=lambda err, msg: results.append((err, msg)))
    p.current.deliver()
    assert results == [(None, b"new")]
    # the old client's record ends on its own (here: its timeout), and its caller hears of it
    stuck.deliver(err="timed out")
    p.poll()
    assert results[-1] == ("timed out", b"old") and len(p) == 0


def test_at_most_one_renewal_per_stall_period_while_the_cluster_stays_down():
    p, clock = make()
    for _ in range(10):
        p.produce("t", b"x")
        clock.now += 10
        p.poll()
    assert p.renewals == 3  # at 30, 60 and 90 s of 100, not at every poll
    assert len(FakeProducer.made) == 4


def test_off_at_zero():
    p, clock = make(stall_s=0)
    p.produce("t", b"x")
    clock.now += 1000
    p.poll()
    assert p.renewals == 0


def test_a_record_stuck_while_others_are_delivered_still_renews_the_producer():
    p, clock = make()
    stuck_cb = []
    p.produce("requests", b"stuck", on_delivery=lambda err, msg: stuck_cb.append(err))
    held = p.current.pending.pop()  # this partition's leader never answers...
    for _ in range(4):
        clock.now += 10
        p.produce("cancellations", b"ok")  # ...while another topic's records go through
        p.current.deliver()
        p.poll()
    assert p.renewals == 1
    held[1]("timed out", held[0])
    assert stuck_cb == ["timed out"]
