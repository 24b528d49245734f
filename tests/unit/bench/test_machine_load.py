"""The benchmark's reading of the machine's CPU time (no broker)."""

from __future__ import annotations


def test_busy_and_steal_are_shares_of_all_cpu_time_in_between(tmp_path, bench_run):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3\n")
    before = bench_run.cpu_times(stat)
    stat.write_text("cpu  160 0 70 880 20 0 10 60 0 0\ncpu0 1 2 3\n")
    after = bench_run.cpu_times(stat)
    # in between: user 60, system 20, idle 80, iowait 10, softirq 5, steal 25: 200 ticks
    assert bench_run.machine_load(before, after) == {"busy_pct": 42.5, "steal_pct": 12.5}


def test_without_proc_stat_the_scenario_just_has_no_machine_figures(tmp_path, bench_run):
    assert bench_run.cpu_times(tmp_path / "missing") is None
    assert bench_run.machine_load(None, [1, 2, 3, 4, 5, 6, 7, 8]) == {}
