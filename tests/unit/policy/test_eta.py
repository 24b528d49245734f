"""The wait ahead of a new request in the workers' order: bands strictly, partitions in turn."""

from __future__ import annotations

import pytest

from pipeline.models import Priority
from pipeline.policy.eta import ahead_of, fair_share, served_in_turn
from pipeline.policy.queues import QueueModel

T0 = 1_800_000_000_000
NORMAL = Priority.NORMAL.rank


def test_serving_in_turn_empties_the_short_queues_first():
    assert served_in_turn([10, 2, 5], 6) == [8, 0, 3]
    assert served_in_turn([10, 2, 5], 12) == [5, 0, 0]
    assert served_in_turn([10, 2, 5], 0) == [10, 2, 5]
    assert served_in_turn([10, 2, 5], 100) == [0, 0, 0]
    assert sum(served_in_turn([7, 3, 3, 0], 8.5)) == pytest.approx(13 - 8.5)


def test_a_request_on_a_short_partition_waits_for_a_round_not_for_the_backlog():
    bands = [[0, 0], [0, 0], [500, 0], [0, 0], [0, 0]]
    assert ahead_of(bands, NORMAL, 1, 0)[0] == pytest.approx(0.5)  # half a request of the busy partition
    assert ahead_of(bands, NORMAL, 0, 0)[0] == pytest.approx(500 + 0.5 * 0)  # behind its own backlog
    assert ahead_of(bands, NORMAL, None, 0)[0] == 500  # partition unknown: first come, first served


def test_higher_bands_come_first_and_lower_ones_never():
    bands = [[3, 3], [0, 0], [4, 0], [0, 0], [100, 100]]
    assert ahead_of(bands, NORMAL, 1, 0)[0] == pytest.approx(6 + 0.5)
    assert ahead_of(bands, NORMAL, 1, 6)[0] == pytest.approx(0.5)  # the higher bands were served first
    assert ahead_of(bands, Priority.CRITICAL.rank, 0, 0)[0] == pytest.approx(3 + 3)  # 3 of its own, all 3 of the other


def test_a_backlogged_partition_gets_its_max_min_fair_share():
    assert fair_share(160, [19, 19, 19, 19, 19]) == pytest.approx(65)  # the others ask for less
    assert fair_share(160, [100, 100, 10]) == pytest.approx(50)  # 10 taken, the rest split in three
    assert fair_share(160, []) == 160


def test_a_backlogged_partition_waits_at_its_share_while_the_others_keep_arriving():
    parts = lambda deep: [[0] * 4, [0] * 4, [deep, 0, 0, 0], [0] * 4, [0] * 4]  # noqa: E731
    q = QueueModel([0] * 5, commit_lag_ms=0, partition_of=lambda t: 0 if t == "busy" else 1)
    for i in range(61):  # 100/s drained; partitions 1-3 bring 15/s each, partition 0 has 50 queued
        ends = [[0] * 4, [0] * 4, [50 + 27 * i] + [15 * i // 2] * 3, [0] * 4, [0] * 4]
        q.observe([0, 0, 50, 0, 0], 50 + 50 * i, 50 * i, T0 + i * 500, partitions=parts(50), ends=ends)
    at = T0 + 30_000
    # Partition 0 drains at what the others leave, 100 - 3 x 15 = 55/s: its 51st request waits
    # about 0.9 s, not the 0.5 s of the requests queued now.
    assert q.eta_ms(NORMAL, at, "busy") == pytest.approx(50.5 / 55 * 1000, rel=0.1)


def test_the_queue_model_quotes_each_tenant_its_own_wait():
    q = QueueModel([0] * 5, commit_lag_ms=0, partition_of=lambda t: 0 if t == "flooder" else 1)
    for i in range(21):  # 100/s drained from a standing queue in partition 0
        q.observe([0, 0, 400, 0, 0], 400 + 50 * i, 50 * i, T0 + i * 500,
                  partitions=[[0, 0], [0, 0], [400, 0], [0, 0], [0, 0]])
    at = T0 + 10_000
    assert q.eta_ms(NORMAL, at, "flooder") == pytest.approx(4_000, rel=0.02)
    assert q.eta_ms(NORMAL, at, "quiet") == pytest.approx(5, abs=1)
    q.admitted(NORMAL, "quiet")
    q.admitted(NORMAL, "quiet")
    assert q.check(NORMAL, now_ms=at, tenant="quiet").position == 2 + 3  # 2 of its own, 2.5 of the other


def test_the_model_is_calibrated_by_the_waits_completions_report():
    q = QueueModel([0] * 5, commit_lag_ms=0)
    for i in range(21):
        q.observe([0, 0, 100, 0, 0], 100 + 50 * i, 50 * i, T0 + i * 500)
    at = T0 + 10_000
    raw = q.eta_ms(NORMAL, at)
    for n in range(200):  # every request waits 400 ms longer than predicted (10 ms more for each one ahead)
        q.admitted(NORMAL, "t", f"r{n}", at)
        q.waited(NORMAL, raw + n * 10 + 400, at, None, f"r{n}")
    assert q.eta_ms(NORMAL, at) == pytest.approx(raw + 400 + 200 * 1000 / 100, rel=0.05)
    q.waited(NORMAL, 10_000, at, None, "unknown")  # not predicted here: no calibration from it
    assert q.snapshot()["bands"]["NORMAL"]["eta_bias_ms"] == pytest.approx(400, rel=0.01)


def test_only_a_tenants_own_backlog_can_make_its_deadline_hopeless():
    q = QueueModel([0] * 5, commit_lag_ms=0, partition_of=lambda t: 0 if t == "flooder" else 1)
    for i in range(21):  # saturated: 100/s drained, 2,000 of the flooder's queued in partition 0
        q.observe([0, 0, 2_000, 0, 0], 2_000 + 50 * i, 50 * i, T0 + i * 500,
                  partitions=[[0, 0], [0, 0], [2_000, 0], [0, 0], [0, 0]])
    at = T0 + 10_000
    # The flooder's next waits for its own 2,000: at least 10 s even at twice the fastest drain.
    assert q.eta_floor_ms(NORMAL, at, "flooder") == pytest.approx(2_000 / 200 * 1000, rel=0.05)
    assert q.eta_floor_ms(NORMAL, at, "quiet") == 0  # nothing of its own ahead: never hopeless
