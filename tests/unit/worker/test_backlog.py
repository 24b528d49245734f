"""A band's queue serves its partitions in turn (pipeline.worker.backlog)."""

from pipeline.worker.backlog import PartitionQueues


def test_a_quiet_partition_is_served_next_not_after_a_busy_one_s_backlog():
    q = PartitionQueues()
    for i in range(100):
        q.append("flooder", f"f{i}")
    q.append("quiet", "q0")
    served = [q.popleft() for _ in range(3)]
    assert served == ["f0", "q0", "f1"]
    assert len(q) == 98


def test_each_partition_keeps_its_own_order_and_partitions_take_turns():
    q = PartitionQueues()
    for p, items in (("a", ["a0", "a1", "a2"]), ("b", ["b0"]), ("c", ["c0", "c1"])):
        for item in items:
            q.append(p, item)
    assert [q.popleft() for _ in range(len(q))] == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert not q


def test_append_reports_the_partition_depth_and_depth_follows_pops():
    q = PartitionQueues()
    assert [q.append("a", i) for i in range(3)] == [1, 2, 3]
    assert q.append("b", 0) == 1
    q.popleft()
    assert q.depth("a") == 2 and q.depth("b") == 1 and q.depth("zz") == 0


def test_a_partition_that_empties_and_refills_joins_the_end_of_the_turn():
    q = PartitionQueues()
    q.append("a", "a0")
    q.append("b", "b0")
    q.append("b", "b1")
    assert q.popleft() == "a0"
    q.append("a", "a1")
    assert [q.popleft() for _ in range(3)] == ["b0", "a1", "b1"]


def test_pop_last_takes_back_the_item_just_queued():
    q = PartitionQueues()
    q.append("a", "a0")
    q.append("b", "b0")
    assert q.pop_last("b") == "b0"
    assert len(q) == 1 and q.popleft() == "a0" and not q


def test_dropping_revoked_partitions_forgets_their_items_only():
    q = PartitionQueues()
    for p in ("a", "b", "c"):
        q.append(p, f"{p}0")
        q.append(p, f"{p}1")
    assert q.drop({"b", "not-queued"}) == 2
    assert len(q) == 4
    assert [q.popleft() for _ in range(4)] == ["a0", "c0", "a1", "c1"]
