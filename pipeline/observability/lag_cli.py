"""`llmq lag` (a table like kafka-consumer-groups --describe) and `llmq lag-exporter`."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

from pipeline.config import Settings
from pipeline.models import Priority
from pipeline.observability.lag import LagCollector, LagReader, LagSnapshot, build_registry
from pipeline.observability.metrics import serve


def _fmt_age(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m"


def snapshot_dict(snap: LagSnapshot, settings: Settings, drain: dict[str, float] | None = None) -> dict:
    bands = snap.by_band(settings)
    out_bands = {}
    for band, info in bands.items():
        rate = (drain or {}).get(band.value)
        eta = info["depth"] / rate if rate else None
        out_bands[band.value] = {**info, "drain_per_s": rate, "eta_s": eta}
    return {
        "taken_at_ms": snap.taken_at_ms,
        "groups": {g.name: {"state": g.state, "members": g.members} for g in snap.groups.values()},
        "partitions": [{"group": p.group, "topic": p.topic, "partition": p.partition, "committed": p.committed,
                        "end": p.end, "lag": p.lag, "time_lag_s": round(p.time_lag_s(snap.taken_at_ms), 3)}
                       for p in snap.partitions],
        "bands": out_bands,
    }


def _drain_rates(before: LagSnapshot, after: LagSnapshot, settings: Settings) -> dict[str, float]:
    """Committed-offset progress per band per second between two snapshots."""
    dt = (after.taken_at_ms - before.taken_at_ms) / 1000.0
    if dt <= 0:
        return {}
    prev = {(p.group, p.topic, p.partition): p.committed or 0 for p in before.partitions}
    rates: dict[str, float] = {}
    for band in Priority:
        from pipeline.observability.lag import band_topics

        topics = band_topics(settings, band)
        per_group: dict[str, int] = {}
        for p in after.partitions:
            if p.topic in topics:
                moved = (p.committed or 0) - prev.get((p.group, p.topic, p.partition), 0)
                per_group[p.group] = per_group.get(p.group, 0) + max(0, moved)
        rates[band.value] = max(per_group.values(), default=0) / dt
    return rates


def render_table(d: dict) -> str:
    lines = [f"{'GROUP':<28} {'TOPIC':<30} {'PART':>4} {'COMMITTED':>10} {'END':>10} {'LAG':>8} {'TIME-LAG':>9}"]
    for p in d["partitions"]:
        committed = "-" if p["committed"] is None else str(p["committed"])
        lines.append(f"{p['group']:<28} {p['topic']:<30} {p['partition']:>4} {committed:>10} {p['end']:>10} "
                     f"{p['lag']:>8} {_fmt_age(p['time_lag_s']):>9}")
    if not d["partitions"]:
        lines.append("(no llmq consumer groups have committed or been assigned anything yet)")
    lines.append("")
    lines.append(f"{'GROUP':<28} {'STATE':<12} {'MEMBERS':>7}")
    for name, g in d["groups"].items():
        lines.append(f"{name:<28} {g['state']:<12} {g['members']:>7}")
    lines.append("")
    lines.append(f"{'PRIORITY':<11} {'DEPTH':>8} {'OLDEST':>9} {'CONSUMERS':>9} {'DRAIN/s':>9} {'ETA':>9}")
    for band, b in d["bands"].items():
        drain = "-" if b["drain_per_s"] is None else f"{b['drain_per_s']:.1f}"
        eta = "-" if b["eta_s"] is None else _fmt_age(b["eta_s"])
        lines.append(f"{band:<11} {b['depth']:>8} {_fmt_age(b['oldest_age_s']):>9} {b['consumers']:>9} "
                     f"{drain:>9} {eta:>9}")
    return "\n".join(lines)


def cmd_lag(settings: Settings, groups: str, as_json: bool, watch: float | None, sample_s: float) -> int:
    reader = LagReader(settings, groups)
    before = reader.snapshot()
    while True:
        time.sleep(watch if watch else sample_s)
        after = reader.snapshot()
        d = snapshot_dict(after, settings, _drain_rates(before, after, settings))
        if as_json:
            print(json.dumps(d), flush=True)
        else:
            if watch:
                sys.stdout.write("\x1b[2J\x1b[H" if sys.stdout.isatty() else "\n")
            print(render_table(d), flush=True)
        if not watch:
            return 0
        before = after


def cmd_lag_exporter(settings: Settings, groups: str, interval: float, port: int, addr: str) -> int:
    collector = LagCollector(LagReader(settings, groups), interval).start()
    serve(build_registry(collector), port, addr, health=collector.health())
    print(f"lag exporter: http://{addr}:{port}/metrics, /healthz, /readyz (refresh every {interval:g}s, "
          f"groups /{groups}/)",
          file=sys.stderr, flush=True)
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    collector.stop()
    return 0
