"""The benchmark's reading of its broker's GC log (no broker)."""

from __future__ import annotations

import datetime


def _at(second: int) -> str:
    return datetime.datetime(2026, 12, 1, 22, 0, second, 500_000, tzinfo=datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%S.%f")[:-3] + "+0000"


def test_a_scenario_counts_the_broker_pauses_inside_its_time_span_only(tmp_path, bench_run):
    log = tmp_path / "gc.log"
    log.write_text("\n".join([
        f"[{_at(0)}] Using G1",
        f"[{_at(1)}] GC(0) Pause Young (Normal) (G1 Evacuation Pause) 24M->8M(1024M) 4.409ms",
        f"[{_at(5)}] GC(1) Pause Young (Normal) (G1 Evacuation Pause) 200M->60M(1024M) 25.500ms",
        f"[{_at(6)}] GC(2) Concurrent Mark Cycle 52.392ms",  # concurrent: not a pause
        f"[{_at(7)}] GC(2) Pause Remark 60M->60M(1024M) 3.296ms",
        f"[{_at(30)}] GC(3) Pause Young (Normal) (G1 Evacuation Pause) 200M->60M(1024M) 9.000ms",
    ]) + "\n")
    start = datetime.datetime(2026, 12, 1, 22, 0, 3, tzinfo=datetime.timezone.utc).timestamp()
    pauses = bench_run.broker_pauses(log, start, start + 10)
    assert pauses == {"pauses": 2, "total_ms": 29, "max_ms": 25.5, "over_20_ms": 1}


def test_no_gc_log_is_no_pauses(tmp_path, bench_run):
    assert bench_run.broker_pauses(tmp_path / "missing.log", 0, 1)["pauses"] == 0


def test_a_line_decorated_otherwise_is_left_out_and_the_rest_still_counted(tmp_path, bench_run):
    log = tmp_path / "gc.log"
    log.write_text(f"[0.845s] GC(0) Pause Young (Normal) (G1 Evacuation Pause) 24M->8M(1024M) 4.4ms\n"
                   f"[{_at(5)}] GC(1) Pause Young (Normal) (G1 Evacuation Pause) 200M->60M(1024M) 7.0ms\n")
    start = datetime.datetime(2026, 12, 1, 22, 0, 0, tzinfo=datetime.timezone.utc).timestamp()
    assert bench_run.broker_pauses(log, start, start + 10)["pauses"] == 1
