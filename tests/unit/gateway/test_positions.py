"""After a rebalance no request record is skipped: when the first record of a partition comes past
the group's committed offset (faust-streaming#221), the records in between are read first."""

from pipeline.gateway.positions import Hole, ReadPositions, RequestPartition

TP = RequestPartition("llm.requests.critical", 2)


def positions(start=4):
    p = ReadPositions(lambda tps: {tp: start for tp in tps})
    p.assigned([TP])
    return p


def test_a_stale_record_past_the_commit_asks_for_the_records_in_between_once():
    p = positions()
    assert p.check(TP, 22) == Hole(first=4, end=22)  # what was left of a batch fetched before the rebalance
    assert p.check(TP, 23) is None  # the hole is read once; from here Faust's order is taken
    assert p.check(TP, 4) is None  # a refetched record below it: decided again, answered the same
    assert p.holes == 1


def test_the_first_record_at_the_commit_disarms_the_guard():
    p = positions()
    assert p.check(TP, 4) is None
    assert p.check(TP, 9) is None  # later holes (transaction markers) are Faust's, as usual
    assert p.holes == 0


def test_records_below_the_commit_and_partitions_never_assigned_are_handled():
    p = positions()
    assert p.check(TP, 3) is None  # already decided: the intake answers it again
    assert p.check(TP, 5) == Hole(4, 5)  # still armed until a record at or past the commit
    assert p.check(RequestPartition("llm.requests.low", 0), 100) is None


def test_a_new_assignment_starts_over():
    p = positions()
    assert p.check(TP, 30) == Hole(4, 30)
    p.assigned([TP])
    assert p.check(TP, 4) is None


def test_offsets_that_cannot_be_read_leave_the_partitions_unguarded():
    def down(tps):
        raise RuntimeError("broker unreachable")

    p = ReadPositions(down)
    p.assigned([TP])
    assert p.check(TP, 50) is None


def test_a_partition_whose_log_start_cannot_be_read_leaves_the_others_guarded(monkeypatch):
    # A broker down: a partition without a commit needs its log start, which fails; the one with
    # a commit keeps its guard (it used to lose it with the rest).
    import confluent_kafka

    from pipeline.config import Settings
    from pipeline.gateway.positions import committed_or_start

    committed_tp, fresh_tp = RequestPartition("llm.requests.critical", 0), RequestPartition("llm.requests.low", 1)

    class Consumer:
        def __init__(self, conf):
            pass

        def committed(self, tps, timeout=None):
            return [confluent_kafka.TopicPartition(t.topic, t.partition, 148 if t.topic == committed_tp.topic else -1001)
                    for t in tps]

        def get_watermark_offsets(self, tp, timeout=None):
            raise confluent_kafka.KafkaException(confluent_kafka.KafkaError(confluent_kafka.KafkaError._UNKNOWN_PARTITION))

    monkeypatch.setattr(confluent_kafka, "Consumer", Consumer)
    read = committed_or_start(Settings.load(env={}), "gw")
    p = ReadPositions(read)
    p.assigned([committed_tp, fresh_tp])
    assert p.check(committed_tp, 204) == Hole(first=148, end=204)
    assert p.check(fresh_tp, 7) is None  # unguarded
