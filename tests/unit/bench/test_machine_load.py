"""The benchmark's reading of the machine's CPU time (no broker)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


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


def test_stalls_are_counted_inside_the_scenarios_window_only(bench_run):
    machine = sys.modules["machine"]  # bench/machine.py, loaded by bench/run.py
    log = "999.0 80.0\n1500.0 120.5\n1800.0 60.0\nnot a line\n2500.0 3000.0\n"
    assert machine.summarise_stalls(log, start=1.0, end=2.0, threshold_ms=50) == {
        "stalls_over_ms": 50, "stalls": 2, "longest_stall_ms": 120.5}
    assert machine.summarise_stalls("", start=1.0, end=2.0, threshold_ms=50)["longest_stall_ms"] == 0.0


def test_the_stall_watch_runs_beside_the_benchmark_and_stops(tmp_path, bench_run):
    machine = sys.modules["machine"]
    watch = machine.StallWatch(tmp_path / "stalls.log", threshold_ms=50)
    try:
        started = time.time()
        time.sleep(0.3)
        assert watch.proc.poll() is None
        assert watch.stalls(started, time.time())["stalls_over_ms"] == 50
    finally:
        watch.stop()
    assert watch.proc.poll() is not None


def test_the_stall_watch_ends_with_a_benchmark_killed_outright(tmp_path, bench_run):
    # A benchmark process that dies without its finally blocks (SIGKILL): its watcher goes too.
    bench_dir = Path(sys.modules["machine"].__file__).parent
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); import machine; "
            "w = machine.StallWatch(machine.Path(sys.argv[2])); print(w.proc.pid, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, str(bench_dir), str(tmp_path / "stalls.log")],
                         capture_output=True, text=True, timeout=30, check=True)
    watcher = int(out.stdout.split()[0])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and Path(f"/proc/{watcher}").exists() \
            and "zombie" not in _state(watcher):
        time.sleep(0.05)
    assert not Path(f"/proc/{watcher}").exists() or "zombie" in _state(watcher)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "gone"


def _runs(*steals):
    """A stand-in for one latency run after another, each with the steal given, numbered."""
    made = []

    def run():
        made.append(len(made) + 1)
        return {"p99_ms": 10 * len(made), "machine": {"steal_pct": steals[len(made) - 1]}}

    return run, made


def test_runs_are_made_until_enough_of_them_had_the_cpu_to_themselves(bench_run):
    machine = sys.modules["machine"]
    run, made = _runs(0.4, 16.3, 1.9, 29.4, 0.1)
    pauses = []
    chosen, aside, quiet = machine.runs_on_a_quiet_machine(run, wanted=3, most=8, steal_pct=2.0, pause_s=15,
                                                           log=lambda msg: None, sleep=pauses.append)
    assert [r["p99_ms"] for r in chosen] == [10, 30, 50] and quiet
    assert [r["p99_ms"] for r in aside] == [20, 40]  # kept, to be reported beside the chosen ones
    assert made == [1, 2, 3, 4, 5] and pauses == [15, 15]


def test_a_machine_that_stays_stolen_from_gives_the_least_stolen_runs_of_the_most_allowed(bench_run):
    machine = sys.modules["machine"]
    run, made = _runs(5.0, 0.5, 9.0, 7.0, 12.0)
    pauses = []
    chosen, aside, quiet = machine.runs_on_a_quiet_machine(run, wanted=3, most=4, steal_pct=2.0, pause_s=15,
                                                           log=lambda msg: None, sleep=pauses.append)
    assert made == [1, 2, 3, 4] and not quiet
    assert [r["p99_ms"] for r in chosen] == [10, 20, 40]  # 5.0, 0.5 and 7.0 % steal, in the order made
    assert [r["p99_ms"] for r in aside] == [30]
    assert pauses == [15, 15]  # none after the last run: nothing follows it


def test_a_run_without_a_steal_figure_counts_as_quiet(bench_run):
    # a machine without /proc/stat (machine_load gives {}) cannot tell; the runs stand as made
    machine = sys.modules["machine"]
    chosen, aside, quiet = machine.runs_on_a_quiet_machine(lambda: {"p99_ms": 1, "machine": {}}, wanted=3, most=8,
                                                           steal_pct=2.0, pause_s=15, log=lambda msg: None,
                                                           sleep=lambda s: None)
    assert len(chosen) == 3 and aside == [] and quiet
