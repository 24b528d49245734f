"""After a rebalance no request record is skipped: a stale record past the committed offset is
sought back from (faust-streaming#221), a real hole in the log is crossed once seen twice."""

from pipeline.gateway.positions import ReadPositions

TP = ("llm.requests.critical", 2)


def positions(start=4):
    p = ReadPositions(lambda tps: {tp: start for tp in tps})
    p.assigned([TP])
    return p


def test_a_stale_record_past_the_commit_is_not_handled_and_the_partition_is_read_again_from_it():
    p = positions()
    assert p.check(TP, 22) == 4  # what was left of a batch fetched before the rebalance
    assert p.check(TP, 23) == 4  # each further stale record: sought back again
    assert p.check(TP, 4) is None  # the records at the commit, in order, from here
    assert p.check(TP, 5) is None and p.check(TP, 22) is None
    assert p.sought == 2


def test_the_first_record_at_the_commit_disarms_the_guard():
    p = positions()
    assert p.check(TP, 4) is None
    assert p.check(TP, 9) is None  # later holes (transaction markers) are Faust's, as usual


def test_a_jump_seen_twice_is_a_hole_in_the_log_and_is_taken():
    p = positions()
    assert p.check(TP, 5) == 4  # offset 4 is a transaction marker: the refetch starts at 5 again
    assert p.check(TP, 5) is None
    assert p.check(TP, 6) is None


def test_records_below_the_commit_and_partitions_never_assigned_are_handled():
    p = positions()
    assert p.check(TP, 3) is None  # already decided: the intake answers it again
    assert p.check(("llm.requests.low", 0), 100) is None


def test_a_new_assignment_starts_over():
    p = positions()
    assert p.check(TP, 30) == 4
    p.assigned([TP])
    assert p.check(TP, 4) is None
