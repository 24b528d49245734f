"""The latency scenarios' rounds measured while the hypervisor took a share of the CPU are set
aside and made again (no broker: the rounds are stand-ins)."""

from __future__ import annotations

import importlib
import itertools


def _stand_ins(monkeypatch, gateway_bench, steals):
    """Each measured half-round takes the next of ``steals``; waits grow with the half-round."""
    steal = iter(steals)
    monkeypatch.setattr(gateway_bench, "cpu_times", lambda: [0])
    monkeypatch.setattr(gateway_bench, "machine_load", lambda before, after: {"steal_pct": next(steal)})
    monkeypatch.setattr(gateway_bench, "_log", lambda msg: None)
    monkeypatch.setattr(gateway_bench, "QUIET_PAUSE_S", 0.0)


def test_a_fairness_round_with_steal_on_either_side_is_set_aside_and_made_again(bench_run, monkeypatch, tmp_path):
    gateway_bench = importlib.import_module("gateway_bench")
    fairness_bench = importlib.import_module("fairness_bench")
    # Each round measures four halves (another partition alone, flooded; the flooder's partition
    # alone, flooded). Round 2's last flooded half and round 4's first alone half were stolen from.
    steals = [0.1] * 4 + [0.1, 0.1, 0.1, 9.0] + [0.1] * 4 + [25.0, 0.1, 0.1, 0.1] + [0.1] * 12
    _stand_ins(monkeypatch, gateway_bench, steals)
    half = itertools.count(1)
    monkeypatch.setattr(gateway_bench, "_quiet_waits", lambda settings, logs, flooder, fifo=False, quiet="q": (
        [1000.0 if fifo else float(next(half))] * 10, {"capacity_per_s": 200.0}))
    monkeypatch.setattr(gateway_bench, "quiet_tenant", lambda settings, same_partition: f"q-{same_partition}")
    monkeypatch.setattr(fairness_bench, "fairness_shares", lambda settings, rounds: {
        "weights_2_to_1": [{"ratio": 2.0}] * 3, "long_answers_10x": [{"ratio": 1.0}] * 3,
        "ten_tenants": [{"jain_index": 0.99}] * 3})
    monkeypatch.setattr(fairness_bench, "burst", lambda settings, over: {"statuses": {over: 1}})
    monkeypatch.setattr(fairness_bench, "worker_killed", lambda settings: {"lost": 0})
    result = gateway_bench.tenant_fairness(None, None)
    assert result["quiet_machine"] is True and result["steal_limit_pct"] == 2.0
    assert result["another_partition"]["alone_runs_ms"] == [1, 9, 17, 21, 25]
    assert result["same_partition"]["flood_runs_ms"] == [4, 12, 20, 24, 28]
    assert result["set_aside_for_steal"] == [
        {"alone_other": 5, "flood_other": 6, "alone_same": 7, "flood_same": 8, "alone_steal_pct": 0.1,
         "flood_steal_pct": 9.0},
        {"alone_other": 13, "flood_other": 14, "alone_same": 15, "flood_same": 16, "alone_steal_pct": 25.0,
         "flood_steal_pct": 0.1}]
    # Each kept round has its FIFO baseline beside the same flooder.
    assert result["baseline_fifo_runs_ms"] == [1000.0] * 5 and result["baseline_fifo_p99_with_flooder_ms"] == 1000.0
    assert result["weights_2_to_1"]["served_tokens_ratio"] == 2.0 and result["jain_index"] == 0.99
    assert result["burst"]["shaped"] == {"statuses": {"delay": 1}} and result["worker_killed"] == {"lost": 0}


def test_priority_isolation_keeps_three_quiet_rounds_each_with_its_fifo_baseline(bench_run, monkeypatch):
    gateway_bench = importlib.import_module("gateway_bench")
    # A round is four parts (alone, flooded, FIFO alone, FIFO flooded); the first round's first was stolen from.
    _stand_ins(monkeypatch, gateway_bench, [3.0, 0.1, 0.1, 0.1] + [0.1] * 12)
    calls = []

    def critical_waits(settings, factor, capacity, seconds, *, fifo, gateway, tmp):
        calls.append((factor, fifo, gateway))
        return [(2500, 10 * len(calls), 1)] * 5  # (created after the onset, wait, until admitted)

    monkeypatch.setattr(gateway_bench, "_critical_waits", critical_waits)
    result = gateway_bench.priority_isolation(None, None)
    assert result["alone_runs_ms"] == [50, 90, 130] and result["flood_runs_ms"] == [60, 100, 140]
    assert result["set_aside_for_steal"] == [{"alone": 10, "flood": 20, "alone_steal_pct": 3.0, "flood_steal_pct": 3.0}]
    assert calls[4:8] == [(0, False, True), (3, False, True), (0, True, True), (3, True, True)]
    assert calls[16:] == [(0, False, False), (3, False, False)]  # the worker-only diagnosis, once
    assert result["baseline_fifo_p99_alone_ms"] == 110 and result["baseline_fifo_p99_flood_ms"] == 120


def test_end_to_end_latency_reports_the_runs_it_set_aside_and_the_median_of_every_run(bench_run, monkeypatch):
    gateway_bench = importlib.import_module("gateway_bench")
    _stand_ins(monkeypatch, gateway_bench, [])
    steal, made = iter([0.5, 16.0, 1.0, 0.3, 0.1, 0.2]), itertools.count(1)

    def latency_at(settings, rate, partitions=None):
        i = next(made)
        return {"rate_per_s": rate, "p50_ms": i, "p99_ms": 10 * i, "admission_p50_ms": 1, "admission_p99_ms": 2,
                "responses": 100, "hops_ms": {"gateway_fetch": {"p50": 1, "p99": 2}},
                "machine": {"steal_pct": next(steal)}}

    monkeypatch.setattr(gateway_bench, "_latency_at", latency_at)
    result = gateway_bench.end_to_end_latency(None, None)
    assert [r["p99_ms"] for r in result["runs"]] == [10, 30, 40] and result["p99_ms"] == 30
    assert [r["p99_ms"] for r in result["set_aside_for_steal"]] == [20]
    assert result["p99_ms_every_run"] == 25.0 and result["quiet_machine"] is True
