"""`eta_accuracy`: how close the wait a client is told (the QUEUED answer's ``eta_ms``) comes to
the wait it gets (``started_at − admitted_at`` of its answer), and whether a request is ever
refused as too late that the workers would have served in time.

One gateway and llmq workers as processes, on the shipped defaults; the workers run a simulated
model (``inflight`` slots × ``latency_ms``), so their capacity is known. Four loads, each on new
topics, each run ``rounds`` times:

- ``steady``: a standing queue of about ``QUEUE_S`` of work, fed at 97 % of the workers' capacity;
- ``burst_after_idle``: a burst of ``BURST_S`` of work, ``IDLE_S`` of nothing, then the same burst,
  measured;
- ``worker_killed``: the steady load on two workers, one SIGKILLed a third of the way in;
- ``other_band_flood``: the steady load in NORMAL beside a BACKGROUND flood of twice the capacity.

Every request has a deadline (``DEADLINE_S``). A request EXPIRED at admission is *wrongly*
expired if, in a run of the same load with ``gateway.early_expiry = false``, the request at the
same place in the schedule was started before its deadline.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from gateway_bench import (GatewayProcess, WorkerProcess, fresh, gateway_config, produce_paced, read_all,
                           warm_up)

from pipeline.models import Priority, Request
from pipeline.serde import Codec

INFLIGHT, LATENCY_MS = 8, 50
CAPACITY = INFLIGHT * 1000 / LATENCY_MS  # requests/s of one worker
#: The standing queue of the steady loads (s of work: a wait under gateway.target_queue_ms, so the
#: load stays below high_load and nothing is demoted), the burst (s of work), the run, the idle
#: spell before the measured burst, and every request's deadline.
QUEUE_S, BURST_S, SECONDS, IDLE_S, DEADLINE_S = 1.0, 3.0, 24.0, 60.0, 20.0
TENANTS = [f"eta-{i}" for i in range(8)]
#: Waits under this are counted as this in the ratio: a client cannot act on a smaller difference.
FLOOR_MS = 50
QUEUED_MS = 250
#: Every setting the scenario runs with that is not llmq's default (the rest are the defaults).
OVERRIDES = {"worker.max_inflight": INFLIGHT, "worker.sim_latency_ms": LATENCY_MS}
LOADS = ("steady", "burst_after_idle", "worker_killed", "other_band_flood")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _requests(n: int, tag: str, priority: Priority = Priority.NORMAL) -> list[Request]:
    return [Request.new(TENANTS[i % len(TENANTS)], f"{tag} {i}", priority=priority, max_tokens=4,
                        timeout_ms=int(DEADLINE_S * 1000), notify_queued=priority is not Priority.BACKGROUND)
            for i in range(n)]


def _schedule(load: str, workers: int) -> tuple[list[tuple[float, Request]], list[Request], float]:
    """(at_s, request) for the whole run, the measured requests (in schedule order), and the
    second at which to SIGKILL a worker (0: none)."""
    cap = CAPACITY * workers
    if load == "burst_after_idle":
        first = _requests(int(cap * BURST_S), "calibrate")
        second = _requests(int(cap * BURST_S), "measured")
        start = BURST_S * 2 + IDLE_S
        return [(0.0, r) for r in first] + [(start, r) for r in second], second, 0.0
    # A standing queue: QUEUE_S of work at once, then arrivals at the capacity.
    backlog = _requests(int(cap * QUEUE_S), "backlog")
    steady = _requests(int(cap * SECONDS * 0.97), "measured")
    out = [(0.0, r) for r in backlog] + [(i / (cap * 0.97), r) for i, r in enumerate(steady)]
    if load == "other_band_flood":
        flood = _requests(int(2 * cap * SECONDS), "flood", Priority.BACKGROUND)
        out += [(i / (2 * cap), r) for i, r in enumerate(flood)]
        out.sort(key=lambda x: x[0])
    # Only what arrives once the gateway has seen the queue drain for a while is measured.
    ids = {r.request_id for r in steady}
    measured = [r for at, r in out if r.request_id in ids and at >= 3.0]
    kill_at = SECONDS / 3 if load == "worker_killed" else 0.0
    return out, measured, kill_at


def _run(settings, load: str, tmp: Path, *, early_expiry: bool = True) -> dict:
    s = fresh(settings)
    workers = 2 if load == "worker_killed" else 1
    overrides = {"gateway": {} if early_expiry else {"early_expiry": False}}
    gw = GatewayProcess(s, gateway_config(overrides), tmp)
    procs = [WorkerProcess(s, tmp, inflight=INFLIGHT, latency_ms=LATENCY_MS) for _ in range(workers)]
    try:
        warmed = warm_up(s, bands=(Priority.NORMAL, Priority.BACKGROUND), tenants=TENANTS)
        schedule, measured, kill_at = _schedule(load, workers)
        t0 = time.monotonic()
        if kill_at:
            import threading

            def kill() -> None:
                time.sleep(max(0.0, t0 + kill_at - time.monotonic()))
                procs[0].proc.kill()

            threading.Thread(target=kill, daemon=True).start()
        sent = produce_paced(s, schedule)
        codec = Codec.default()
        want = {r.request_id for r in measured}
        expect = sum(1 for _, r in schedule if r.notify_queued) + len(schedule) + len(warmed)
        answers = read_all(s, s.topics.responses, codec.decode_response, expect=expect, timeout=180)
    finally:
        for p in procs:
            p.stop()
        gw.stop()
    terminal, queued = {}, {}
    for a in answers:
        if a.request_id in want:
            (terminal if a.status.is_terminal else queued).setdefault(a.request_id, a)
    rows = []
    for i, r in enumerate(measured):
        t, q = terminal.get(r.request_id), queued.get(r.request_id)
        rows.append({"i": i, "status": t.status.value if t else None, "reason": (t.reason or "") if t else "",
                     "band": t.served_priority.value if t and t.served_priority else None,
                     "created_at": r.created_at, "admitted_at": t.admitted_at if t else None,
                     "eta_ms": q.eta_ms if q else None,
                     "wait_ms": (t.started_at - t.admitted_at) if t and t.started_at and t.admitted_at else None,
                     "in_time": bool(t and t.started_at and t.started_at <= r.created_at + DEADLINE_S * 1000)})
    return {"sent": sent, "rows": rows}


def _quantile(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(len(xs) * q))], 3) if xs else None


def _summary(run: dict) -> dict:
    rows = run["rows"]
    both = [r for r in rows if r["eta_ms"] is not None and r["wait_ms"] is not None]
    ratios = [max(r["eta_ms"], FLOOR_MS) / max(r["wait_ms"], FLOOR_MS) for r in both]
    # The p90 of the error in either direction: the ratio farther from 1 (over or under).
    spread = [max(x, 1 / x) for x in ratios]
    # The requests that really queued (quoted or waited QUEUED_MS or more), where a floor cannot
    # make two small numbers look equal.
    queued = [max(r["eta_ms"], FLOOR_MS) / max(r["wait_ms"], FLOOR_MS) for r in both
              if max(r["eta_ms"], r["wait_ms"]) >= QUEUED_MS]
    early = [r for r in rows if r["status"] == "EXPIRED" and "cannot be met" in r["reason"]]
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {"measured": len(rows), "with_eta": len(both), "statuses": statuses,
            "ratio_p50": _quantile(ratios, 0.5), "ratio_p10": _quantile(ratios, 0.1), "ratio_p90": _quantile(ratios, 0.9),
            "error_factor_p90": _quantile(spread, 0.9),
            "queued": len(queued), "queued_ratio_p50": _quantile(queued, 0.5), "queued_ratio_p90": _quantile(queued, 0.9),
            "wait_p50_ms": _quantile([r["wait_ms"] for r in both], 0.5),
            "eta_p50_ms": _quantile([r["eta_ms"] for r in both], 0.5),
            "expired_at_admission": len(early), "early_indexes": [r["i"] for r in early]}


def eta_accuracy(settings, args) -> dict:
    rounds = min(getattr(args, "rounds", 3), 3)
    out: dict = {"loads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for load in LOADS:
            runs = []
            for r in range(rounds):
                summary = _summary(_run(settings, load, Path(tmp)))
                wrong = 0
                if summary["expired_at_admission"]:
                    # The same load without early expiry: was each of those started in time?
                    base = _run(settings, load, Path(tmp), early_expiry=False)["rows"]
                    wrong = sum(1 for i in summary["early_indexes"] if i < len(base) and base[i]["in_time"])
                summary["wrongly_expired"] = wrong
                summary.pop("early_indexes")
                _log(f"  {load} round {r}: ratio p50 {summary['ratio_p50']} p90 {summary['ratio_p90']} "
                     f"(of the {summary['queued']} that queued {QUEUED_MS} ms or more: p50 {summary['queued_ratio_p50']} "
                     f"p90 {summary['queued_ratio_p90']}), "
                     f"statuses {summary['statuses']}, expired at admission {summary['expired_at_admission']} "
                     f"(wrongly {wrong})")
                runs.append(summary)

            def med(key):
                vals = [x[key] for x in runs if x[key] is not None]
                return round(statistics.median(vals), 3) if vals else None

            out["loads"][load] = {"ratio_p50": med("ratio_p50"), "ratio_p10": med("ratio_p10"),
                                  "ratio_p90": med("ratio_p90"), "error_factor_p90": med("error_factor_p90"),
                                  "queued_ratio_p50": med("queued_ratio_p50"),
                                  "queued_ratio_p90": med("queued_ratio_p90"),
                                  "wait_p50_ms": med("wait_p50_ms"), "eta_p50_ms": med("eta_p50_ms"),
                                  "wrongly_expired": sum(x["wrongly_expired"] for x in runs),
                                  "expired_at_admission": sum(x["expired_at_admission"] for x in runs),
                                  "runs": runs}
    out.update({"overrides": OVERRIDES, "rounds": rounds, "worker": f"{INFLIGHT} slots x {LATENCY_MS} ms (simulated)",
                "capacity_per_s": CAPACITY, "deadline_s": DEADLINE_S, "idle_s": IDLE_S, "queue_s": QUEUE_S, "burst_s": BURST_S,
                "floor_ms": FLOOR_MS, "queued_ms": QUEUED_MS,
                "measured": "per request: predicted = the QUEUED answer's eta_ms, actual = started_at - admitted_at; "
                            f"ratio = max(predicted, {FLOOR_MS}) / max(actual, {FLOOR_MS}); error_factor = the ratio "
                            "or its inverse, whichever is larger; queued_ratio_*: the same over requests quoted or waiting "
                            f"{QUEUED_MS} ms or more; medians over rounds of each round's quantiles"})
    return out
