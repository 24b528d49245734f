"""Routing by cache on the real broker, with simulator processes as the model servers.

* Servers whose ``vllm:kv_cache_usage_perc`` counts their cached free blocks as used read full
  while they run nothing: they still get work, every request is answered, and the contradiction
  is counted.
* A server killed mid-run: the conversations placed on it move to the others, every turn is
  answered, and their later turns find the history where it moved.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from pipeline.client import LlmqClient
from pipeline.models import Request
from pipeline.observability.metrics import RoutingSeries
from pipeline.simulator.process import SimulatorProcess
from pipeline.worker.backends.openai_http import OpenAIBackend
from pipeline.worker.backends.pacing import PacingConfig
from pipeline.worker.backends.routing import RoutingTable
from tests.integration.harness import running_worker


def _backend(sims, metrics: RoutingSeries) -> OpenAIBackend:
    routes = RoutingTable({"*": [s.base_url for s in sims]})
    return OpenAIBackend(routes=routes, routing_metrics=metrics, pacing=PacingConfig(initial_limit=4),
                         timeout_s=30)


def _sim(*extra: str) -> SimulatorProcess:
    return SimulatorProcess("--served-model-name", "sim-small", "--max-num-seqs", "4", "--ttft-ms", "2",
                            "--ms-per-token", "2", "--output-tokens", "4", *extra)


def test_servers_whose_kv_reading_stays_full_while_idle_still_get_work(settings):
    settings.worker.backend, settings.worker.max_inflight = "openai", 16
    sims = [_sim("--kv-usage-counts-cached", "--kv-cache-tokens", "2048", "--max-model-len", "2048")
            for _ in range(2)]
    metrics = RoutingSeries()
    try:
        backend = _backend(sims, metrics)
        with running_worker(settings, backend), LlmqClient(settings) as client:
            answers = []
            for wave in range(4):  # waves with idle gaps: each server fills its cache and idles full
                reqs = [Request.new(f"t{i % 3}", f"wave {wave} prompt {i} " + "filler text " * 120,
                                    model="sim-small", max_tokens=4, timeout_ms=60_000) for i in range(12)]
                for r in reqs:
                    client.submit(r)
                answers += [client.result(r.request_id, timeout=60) for r in reqs]
                time.sleep(0.5)
            full_idle = [httpx_kv(s) for s in sims]
    finally:
        for s in sims:
            s.stop()
    assert [a.status.value for a in answers] == ["COMPLETED"] * 48
    assert all(kv >= 0.95 for kv in full_idle), full_idle  # they did read full while idle
    contradictions = {k[0]: c.value for k, c in metrics.kv_contradictions.children.items()}
    assert len(contradictions) == 2 and all(v >= 1 for v in contradictions.values()), contradictions


def httpx_kv(sim: SimulatorProcess) -> float:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{sim.port}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:kv_cache_usage_perc"))
    return float(line.rsplit(" ", 1)[1])


def _turn(conversation: int, turn: int) -> Request:
    messages = [{"role": "system", "content": "You are terse. " * 60},
                {"role": "user", "content": f"conversation {conversation} begins here " * 10}]
    for t in range(1, turn):
        messages += [{"role": "assistant", "content": f"answer {t} " * 20}, {"role": "user", "content": f"go on {t}"}]
    return Request.new(f"t{(conversation + turn) % 5}", None, messages=messages, model="sim-small", max_tokens=4,
                       timeout_ms=60_000)


def _hits(sim: SimulatorProcess) -> float:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{sim.port}/metrics", timeout=5).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("vllm:prefix_cache_hits_total"))


def test_a_killed_servers_conversations_move_to_the_others(settings):
    settings.worker.backend, settings.worker.max_inflight = "openai", 16
    sims = [_sim() for _ in range(3)]
    metrics = RoutingSeries()
    try:
        backend = _backend(sims, metrics)
        with running_worker(settings, backend), LlmqClient(settings) as client:

            def converse(c: int, turns: range) -> list:
                out = []
                for t in turns:
                    r = _turn(c, t)
                    client.submit(r)
                    out.append(client.result(r.request_id, timeout=60))
                return out

            with ThreadPoolExecutor(6) as pool:
                first = [a for f in [pool.submit(converse, c, range(1, 3)) for c in range(12)] for a in f.result()]
                routed: dict[str, float] = {}
                for (server, _reason), child in metrics.routes.children.items():
                    routed[server] = routed.get(server, 0.0) + child.value
                victim = max(sims, key=lambda s: routed.get(s.base_url, 0))
                victim.stop()
                alive = [s for s in sims if s is not victim]
                hits_before = sum(_hits(s) for s in alive)
                rest = [a for f in [pool.submit(converse, c, range(3, 6)) for c in range(12)] for a in f.result()]
            hits_after = sum(_hits(s) for s in alive)
    finally:
        for s in sims:
            s.stop()
    assert [a.status.value for a in first + rest] == ["COMPLETED"] * (24 + 36)
    # Turns 4 and 5 of the moved conversations found turn 3's history where it had gone.
    assert hits_after - hits_before > 0
