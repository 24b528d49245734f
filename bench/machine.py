"""What the machine itself did while a scenario ran: CPU shares and stalls.

This machine is two cores shared with a hypervisor's other guests. Latency figures moved with
the machine (the end-to-end p99 at 1,000 req/s was 34-53 ms in runs with under 1 % steal on
a warmed broker and 57-160 ms with 3-30 %), so every scenario's result says how busy the
machine was, how much of it the hypervisor took, and whether anything on it stopped for longer
than a scheduler would ever hold a sleeping process back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def cpu_times(stat: Path = Path("/proc/stat")) -> list[int] | None:
    """The machine's CPU time so far (Linux ``/proc/stat``, all CPUs): user, nice, system, idle,
    iowait, irq, softirq, steal, in ticks; None where there is no such file."""
    try:
        first = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    return [int(x) for x in first[1:9]] if first and first[0] == "cpu" else None


def machine_load(before: list[int] | None, after: list[int] | None) -> dict:
    """Where the machine's CPU time went between two ``cpu_times()``, in percent of all CPUs'
    time: busy (everything but idle and iowait) and steal (time the hypervisor gave another
    guest)."""
    if not before or not after:
        return {}
    d = [b - a for a, b in zip(before, after)]
    total = sum(d)
    if total <= 0:
        return {}
    idle = d[3] + d[4]
    return {"busy_pct": round(100 * (total - idle - d[7]) / total, 1), "steal_pct": round(100 * d[7] / total, 1)}


# The watcher: its own small process, so that neither the benchmark's interpreter lock nor its
# collector is measured. A process that sleeps 10 ms is woken within a few ms even on two busy
# cores (the scheduler favours sleepers); a longer gap means the whole guest stood still.
_WATCH = r"""
import os, sys, time
threshold, out = float(sys.argv[1]) / 1000, open(sys.argv[2], "a", buffering=1)
parent = int(sys.argv[3])  # the benchmark's pid, given: it may be gone before this line runs
while os.getppid() == parent:  # a benchmark killed outright leaves no watcher behind
    t = time.monotonic()
    time.sleep(0.01)
    late = time.monotonic() - t - 0.01
    if late > threshold:
        out.write(f"{time.time() * 1000 - late * 1000:.0f} {late * 1000:.1f}\n")
"""


class StallWatch:
    """Records every moment a sleeping process woke more than ``threshold_ms`` late.

    ``stalls(start, end)`` (wall-clock seconds) summarises those inside the window."""

    def __init__(self, path: Path, threshold_ms: float = 50.0):
        self.path = path
        self.threshold_ms = threshold_ms
        path.touch()
        self.proc = subprocess.Popen([sys.executable, "-c", _WATCH, str(threshold_ms), str(path), str(os.getpid())],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def stalls(self, start: float, end: float) -> dict:
        return summarise_stalls(self.path.read_text(), start, end, self.threshold_ms)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def summarise_stalls(log: str, start: float, end: float, threshold_ms: float) -> dict:
    """``log``: lines of "<wall-clock ms when the sleep began> <ms late>"."""
    lates = []
    for line in log.splitlines():
        try:
            at_ms, late_ms = (float(x) for x in line.split())
        except ValueError:
            continue
        if start * 1000 <= at_ms <= end * 1000:
            lates.append(late_ms)
    return {"stalls_over_ms": threshold_ms, "stalls": len(lates), "longest_stall_ms": round(max(lates, default=0.0), 1)}


def steal_of(result: dict) -> float | None:
    return result.get("machine", {}).get("steal_pct")


def runs_on_a_quiet_machine(run, *, wanted: int, most: int, steal_pct: float, pause_s: float,
                            log=print, sleep=None) -> tuple[list[dict], list[dict], bool]:
    """Call ``run()`` (a dict with ``machine.steal_pct``) until ``wanted`` of its runs had the
    hypervisor take under ``steal_pct`` of the CPU, or ``most`` runs were made; after a stolen
    run, wait ``pause_s`` first (steal comes in spells). Returns (chosen, set aside, quiet):
    the ``wanted`` runs under the limit if there were that many, else the ``wanted`` runs with
    the least steal, each in the order made; the other runs; whether the chosen were all under.

    Which runs count is decided by the steal measured during each run, never by its result,
    and the runs set aside are returned to be reported beside the chosen ones. A run without a
    steal figure (no ``/proc/stat``) counts as quiet."""
    import time

    sleep = sleep or time.sleep

    def quiet(result: dict) -> bool:
        steal = steal_of(result)
        return steal is None or steal < steal_pct

    made: list[dict] = []
    while sum(map(quiet, made)) < wanted and len(made) < most:
        made.append(run())
        if not quiet(made[-1]):
            log(f"  run {len(made)}: the hypervisor took {steal_of(made[-1])} % of the CPU "
                f"(limit {steal_pct} %): set aside, run again in {pause_s:.0f} s")
            if len(made) < most:
                sleep(pause_s)
    enough = sum(map(quiet, made)) >= wanted
    if enough:
        picked = {i for i, r in enumerate(made) if quiet(r)}
    else:
        picked = set(sorted(range(len(made)), key=lambda i: steal_of(made[i]) or 0.0)[:wanted])
    return ([r for i, r in enumerate(made) if i in picked], [r for i, r in enumerate(made) if i not in picked],
            enough)
