"""tenant_fairness's share scenarios: who gets the model's tokens when several tenants wait.

Each run is one gateway and ``llmq worker`` processes on the simulated model, on llmq's
defaults except what a scenario says (listed in its result). Tenants' backlogs are sent at
once; the gateway shapes them to their rate limits (the default "delay") and the worker's fair
queue shares the two slots. A tenant's *served tokens* are prompt + 2 x output of its
requests that started inside the measured window, while every tenant still had work waiting.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import tempfile
import time
from pathlib import Path

from gateway_bench import GatewayProcess, WorkerProcess, _log, drop_topics, fresh, gateway_config, produce_paced, \
    read_all, warm_up

from pipeline.config import Settings
from pipeline.models import Priority, Request, Status
from pipeline.observability.fairness import jain
from pipeline.policy.fair_queue import request_cost
from pipeline.serde import Codec

#: The simulated model: 2 slots, 10 ms a call plus this much per output token.
SLOTS, LATENCY_MS, MS_PER_TOKEN = 2, 10, 0.5
#: The share runs' band. In NORMAL, the gateway's rising load moves tenants' work down to LOW
#: (gateway.high_load) at different moments, and for seconds one tenant's work is in NORMAL while
#: the other's is in LOW, served in band order: that measures the priority policy, not the
#: sharing inside a band. BACKGROUND has no band below it.
SHARE_BAND = Priority.BACKGROUND
#: The measured window, after the first start (the first seconds: backlogs building, the first
#: fetches of new partitions).
WINDOW_FROM_S, WINDOW_S = 3.0, 6.0


def _registry_config(tmp: Path, weights: dict[str, float]) -> dict[str, str]:
    """The workers' env for a config file holding tenant records with these weights."""
    if not weights:
        return {}
    path = tmp / "tenants.toml"
    path.write_text("".join(f'[tenants.records."{t}"]\nweight = {w}\n' for t, w in weights.items()))
    return {"LLMQ_CONFIG": str(path)}


@contextlib.contextmanager
def _pipeline(s: Settings, gateway: dict, *, workers: int = 1, inflight: int = SLOTS, latency_ms: float = LATENCY_MS,
              env: dict[str, str] | None = None, weights: dict[str, float] | None = None):
    """A gateway (config ``gateway``) and ``workers`` worker processes on ``s``'s fresh topics;
    yields the workers; stops everything and drops the topics after."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        gw = GatewayProcess(s, gateway_config(gateway), tmp)
        env = {**(env or {}), **_registry_config(tmp, weights or {})}
        procs = [WorkerProcess(s, tmp, inflight=inflight, latency_ms=latency_ms, env=env) for _ in range(workers)]
        try:
            yield procs
        finally:
            for p in procs:
                p.stop()
            gw.stop()
            drop_topics(s)


def _responses(s: Settings, ids: set[str], timeout_s: float = 180.0) -> list:
    """The responses to ``ids`` (others on the topic, the warm-up's, left out), once each id has a
    terminal one or ``timeout_s`` passed."""
    codec = Codec.default()
    deadline = time.monotonic() + timeout_s
    while True:
        got = [r for r in read_all(s, s.topics.responses, codec.decode_response, expect=10**9, timeout=2, drain=True)
               if r.request_id in ids]
        if {r.request_id for r in got if r.status is not Status.QUEUED} >= ids or time.monotonic() > deadline:
            return got
        time.sleep(1)


def shares(settings: Settings, tenants: dict[str, dict], *, workers: int = 1) -> dict:
    """``tenants``: name → {"requests", "max_tokens", "weight"}. Served tokens per tenant in the window."""
    s = fresh(settings)
    weights = {t: spec["weight"] for t, spec in tenants.items() if spec.get("weight", 1) != 1}
    with _pipeline(s, {}, workers=workers, env={"LLMQ_WORKER__SIM_MS_PER_TOKEN": str(MS_PER_TOKEN)}, weights=weights):
        warm_up(s, bands=(SHARE_BAND,), tenants=tuple(tenants))
        order = []
        for i in range(max(spec["requests"] for spec in tenants.values())):
            for name, spec in tenants.items():
                if i < spec["requests"]:
                    order.append((0.0, Request.new(name, f"{name} {i}", timeout_ms=600_000,
                                                   max_tokens=spec["max_tokens"], priority=SHARE_BAND)))
        sent = produce_paced(s, iter(order))
        got = _responses(s, {req.request_id for _, req in order})
    started = [r for r in got if r.status is Status.COMPLETED and r.started_at]
    first = min(r.started_at for r in started)
    lo, hi = first + WINDOW_FROM_S * 1000, first + (WINDOW_FROM_S + WINDOW_S) * 1000
    served: collections.Counter = collections.Counter()
    for r in started:
        if lo <= r.started_at < hi:
            served[r.tenant_id] += request_cost(r.prompt_tokens, r.completion_tokens)
    statuses = collections.Counter(r.status.value for r in got)
    return {"served_tokens": {t: served[t] for t in tenants}, "statuses": dict(statuses), "sent": sent,
            "answered": len({r.request_id for r in got if r.status is not Status.QUEUED})}


def weights_two_to_one(settings: Settings) -> dict:
    out = shares(settings, {"gold": {"requests": 1500, "max_tokens": 8, "weight": 2.0},
                            "plain": {"requests": 1500, "max_tokens": 8}})
    tokens = out["served_tokens"]
    out["ratio"] = round(tokens["gold"] / max(1, tokens["plain"]), 3)
    return out


def long_answers(settings: Settings) -> dict:
    out = shares(settings, {"long": {"requests": 500, "max_tokens": 40}, "short": {"requests": 2000, "max_tokens": 4}})
    tokens = out["served_tokens"]
    out["ratio"] = round(tokens["long"] / max(1, tokens["short"]), 3)
    return out


def ten_tenants(settings: Settings) -> dict:
    out = shares(settings, {f"t{i}": {"requests": 600, "max_tokens": 4 * (i + 1)} for i in range(10)})
    out["jain_index"] = round(jain(list(out["served_tokens"].values())), 4)
    return out


# -- a burst, shaped ----------------------------------------------------------------------------

BURST_TENANTS, BURST_REQUESTS = 7, 2000


def burst(settings: Settings, over: str = "delay") -> dict:
    """2,000 requests from 7 tenants at once on an idle system. ``over``: the default rate limits
    with "delay" (shaped) or "refuse" (as before shaping existed)."""
    s = fresh(settings)
    limits = {name: {**spec, "over": over} for name, spec in Settings.load(env={}).gateway.limits.items()}
    tenants = [f"burst-{i}" for i in range(BURST_TENANTS)]
    with _pipeline(s, {"gateway": {"limits": limits}}, inflight=16, latency_ms=5):
        warm_up(s, bands=(Priority.NORMAL,), tenants=tuple(tenants))
        reqs = [(0.0, Request.new(tenants[i % BURST_TENANTS], f"b{i}", timeout_ms=60_000, max_tokens=4))
                for i in range(BURST_REQUESTS)]
        sent = produce_paced(s, iter(reqs))
        got = _responses(s, {req.request_id for _, req in reqs})
    final = {r.request_id: r for r in got if r.status is not Status.QUEUED}
    statuses = collections.Counter(r.status.value for r in final.values())
    late = sum(1 for r in final.values() if r.finished_at and r.finished_at > r.created_at + 60_000)
    per_second = Settings.load(env={}).gateway.limits["per_second"]
    most_in_a_second = {}
    for t in tenants:
        starts = sorted(r.started_at for r in final.values() if r.tenant_id == t and r.started_at)
        most, j = 0, 0
        for i, at in enumerate(starts):
            while starts[j] <= at - 1000:
                j += 1
            most = max(most, i - j + 1)
        most_in_a_second[t] = most
    return {"over": over, "sent": sent, "answered": len(final), "statuses": dict(statuses),
            "finished_after_deadline": late, "most_started_in_any_second": max(most_in_a_second.values()),
            "limit": f"{per_second['requests']} requests a second, burst {per_second.get('burst') or per_second['requests']}"}


# -- kill -9 of a worker mid-run ------------------------------------------------------------------


def worker_killed(settings: Settings) -> dict:
    """Two tenants backlogged, two workers; one SIGKILLed mid-run. Every id answered, none twice differently."""
    s = fresh(settings)
    with _pipeline(s, {}, workers=2) as procs:
        warm_up(s, bands=(Priority.NORMAL,), tenants=("a", "b"))
        reqs = [(i / 150, Request.new("ab"[i % 2], f"k{i}", timeout_ms=600_000, max_tokens=4)) for i in range(1500)]

        def paced():
            for n, item in enumerate(reqs):
                if n == len(reqs) // 2:
                    os.kill(procs[0].proc.pid, signal.SIGKILL)
                yield item

        sent = produce_paced(s, paced())
        got = _responses(s, {req.request_id for _, req in reqs})
    by_id: dict[str, set] = collections.defaultdict(set)
    for r in got:
        if r.status is not Status.QUEUED:
            by_id[r.request_id].add(r.status.value)
    ids = {req.request_id for _, req in reqs}
    return {"sent": sent, "answered": len(ids & set(by_id)), "lost": len(ids - set(by_id)),
            "answered_twice_differently": sum(1 for v in by_id.values() if len(v) > 1),
            "statuses": dict(collections.Counter(next(iter(v)) for v in by_id.values()))}


def fairness_shares(settings: Settings, rounds: int = 3) -> dict:
    """Each share scenario ``rounds`` times (medians are the caller's)."""
    out: dict = {"weights_2_to_1": [], "long_answers_10x": [], "ten_tenants": []}
    for r in range(rounds):
        for name, run in (("weights_2_to_1", weights_two_to_one), ("long_answers_10x", long_answers),
                          ("ten_tenants", ten_tenants)):
            result = run(settings)
            _log(f"  {name} round {r + 1}: " + ", ".join(f"{k} {v}" for k, v in result.items()
                                                          if k in ("ratio", "jain_index", "served_tokens")))
            out[name].append(result)
    return out
