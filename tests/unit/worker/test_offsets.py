from pipeline.worker.offsets import OffsetTracker

TP = ("llm.requests.high", 0)


def test_commit_position_is_one_past_the_contiguous_finished_prefix():
    t = OffsetTracker()
    for off in (10, 11, 12, 13):
        t.started(TP, off)
    t.finished(TP, 11)
    t.finished(TP, 13)
    assert t.to_commit() == []  # 10 is still running: nothing may be committed
    t.finished(TP, 10)
    assert t.to_commit() == [(TP, 12)]  # 10, 11 done; 12 holds the position
    t.finished(TP, 12)
    assert t.to_commit() == [(TP, 14)]


def test_a_slow_message_is_never_committed_past():
    t = OffsetTracker()
    for off in range(100):
        t.started(TP, off)
    for off in range(1, 100):
        t.finished(TP, off)
    assert t.to_commit() == []
    assert t.in_flight(TP) == 100


def test_positions_are_reported_once_until_they_move():
    t = OffsetTracker()
    t.started(TP, 0)
    t.finished(TP, 0)
    positions = t.to_commit()
    t.mark_committed(positions)
    assert t.to_commit() == []
    t.started(TP, 1)
    t.finished(TP, 1)
    assert t.to_commit() == [(TP, 2)]


def test_gaps_in_offsets_from_compaction_or_transaction_markers_do_not_block():
    t = OffsetTracker()
    for off in (5, 9, 20):
        t.started(TP, off)
    for off in (20, 9, 5):
        t.finished(TP, off)
    assert t.to_commit() == [(TP, 21)]


def test_finishing_after_the_partition_was_revoked_is_ignored():
    t = OffsetTracker()
    t.started(TP, 0)
    t.forget(TP)
    t.finished(TP, 0)
    assert t.to_commit() == []


def test_partitions_are_independent_and_only_filter_limits_the_report():
    other = ("llm.requests.low", 2)
    t = OffsetTracker()
    t.started(TP, 0)
    t.started(other, 7)
    t.finished(other, 7)
    assert t.to_commit() == [(other, 8)]
    assert t.to_commit(only={TP}) == []


def test_a_failed_asynchronous_commit_is_reported_again():
    t = OffsetTracker()
    t.started(TP, 0)
    t.finished(TP, 0)
    positions = t.to_commit()
    t.mark_committed(positions)
    t.commit_failed(positions)
    assert t.to_commit() == [(TP, 1)]


# -- offsets finished past the committed position, carried in commit metadata -------------------

from pipeline.worker.offsets import MAX_METADATA_CHARS, decode_done, encode_done  # noqa: E402


def test_done_offsets_round_trip_as_relative_ranges():
    done = {101, 102, 103, 107, 200}
    text = encode_done(100, done)
    assert text == "llmq.done1:1+2,7,100"
    assert decode_done(100, text) == done
    assert encode_done(100, set()) == ""


def test_a_list_too_long_for_the_broker_is_cut_short_never_wrong():
    done = set(range(1, 20_000, 2))  # no runs: the worst case
    text = encode_done(0, done)
    assert len(text) <= MAX_METADATA_CHARS
    assert decode_done(0, text) <= done and len(decode_done(0, text)) > 500


def test_foreign_or_garbled_metadata_lists_nothing_beyond_what_is_readable():
    assert decode_done(5, "") == set()
    assert decode_done(5, "some other tool's note") == set()
    assert decode_done(5, "llmq.done1:2,x,9") == {7}
    assert decode_done(5, "llmq.done1:0,3") == set()  # 0 would be the committed offset itself
    assert decode_done(5, "llmq.done1:1+99999999") == set()  # absurd sizes are ignored


def test_a_slow_head_still_lets_the_finished_ones_behind_it_be_recorded():
    t = OffsetTracker()
    tp = ("topic", 0)
    for off in range(10, 15):
        t.started(tp, off)
    for off in (11, 12, 14):
        t.finished(tp, off)
    [(got_tp, position, metadata)] = t.to_commit_with_done()
    assert got_tp == tp and position == 10
    assert decode_done(position, metadata) == {11, 12, 14}
    t.mark_committed_with_done([(tp, position, metadata)])
    assert t.to_commit_with_done() == []  # nothing new
    t.finished(tp, 10)
    [(_, position, metadata)] = t.to_commit_with_done()
    assert position == 13 and decode_done(13, metadata) == {14}
