"""A 10,000-line batch through OpenAI's Batch API beside interactive chat at 50 requests a second.

Set-up: the project's vLLM-like simulator (``SLOTS`` slots, ``MS_PER_TOKEN`` a decode step,
``TTFT_MS`` of prefill in a request's first step, no slowdown with the batch's size: the slots are
independent, so what the batch does to interactive latency is llmq's doing, not the engine's) as a
server process; one ``llmq worker`` process (OpenAI backend, metrics-driven pacing, preemption of
LOW and BACKGROUND as shipped) on the request topics; one ``llmq serve`` process holding the Batch
API. Interactive chat: NORMAL requests from the SDK, paced at ``RATE`` a second, each stamped from
its scheduled send. Interactive requests and batch lines ask for the same ``TOKENS``, so a slot
serves either in the same time.

1. interactive alone for ``ALONE_S`` s (after a warm-up): its p99;
2. the batch (``LINES`` lines, BACKGROUND, uploaded with ``POST /v1/files`` and started with
   ``POST /v1/batches``) beside the same interactive load, until it completes;
3. capacity: a batch of ``CAPACITY_LINES`` alone, its lines a second once the slots are full.

Reported while the batch has lines waiting (from its first answer until 95 % are answered, so its
drained tail is left out): interactive p99 against phase 1's; the server's slots busy (sampled
every 20 ms); the batch's lines a second against what the interactive load leaves of the capacity
(phase 3's rate less the interactive rate).

Run alone: ``python bench/run.py batch_beside_interactive``.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from backend_bench import Sampler, cpu_s  # bench/, beside this script
from failover_bench import LlmqProcess
from gateway_bench import drop_topics, fresh, p99

from pipeline.config import Settings
from pipeline.models import Priority, Request, Status
from pipeline.simulator.process import SimulatorProcess
from pipeline.tenants.keys import hash_key

SLOTS, TTFT_MS, MS_PER_TOKEN, TOKENS = 32, 1, 5, 64
RATE = 50
INTERACTIVE_TOKENS = BATCH_TOKENS = TOKENS
#: LLMQ_BENCH_BATCH_LINES / LLMQ_BENCH_ALONE_S: a quicker run while working on it (results say the figures used).
LINES = int(os.environ.get("LLMQ_BENCH_BATCH_LINES", "10000"))
WARM_S, ALONE_S = 5.0, float(os.environ.get("LLMQ_BENCH_ALONE_S", "30"))
CAPACITY_LINES = max(500, LINES * 3 // 10)
KEY = "bench-batch-key-0123456789"
TARGET = {"interactive_p99_ratio": 1.2, "batch_share_of_leftover": 0.9, "slot_busy_fraction": 0.97}
#: Everything set here that is not a shipped default.
OVERRIDES = {"worker": "--backend openai --openai-base-url <simulator>, reading the request topics (no gateway)",
             "serve": "--port <free>, tenants.file with one tenant (the batch's and the chat's)",
             "preemption_off rounds": "worker.preempt_bands = [] (the comparison, not the figures quoted)"}


class TimedSampler(Sampler):
    """The server's load every 20 ms, with when: (epoch s, running, waiting)."""

    def run(self) -> None:
        while not self._halt.wait(0.02):
            self.samples.append((time.time(), *self.sim.load()))


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _processes(s: Settings, workdir: Path, base_url: str, worker_env: dict[str, str]) -> tuple[LlmqProcess, LlmqProcess, str]:
    workdir.mkdir(parents=True, exist_ok=True)
    tenants = workdir / "tenants.toml"
    tenants.write_text(f'[bulk]\nmax_priority = "CRITICAL"\nkey_hashes = ["{hash_key(KEY)}"]\n\n'
                       '[chat]\nmax_priority = "CRITICAL"\n')
    from pipeline.broker import free_port

    metrics_port = free_port()
    env = {**os.environ, **s.topology_env(), "LLMQ_WORKER__METRICS_PORT": str(metrics_port),
           "LLMQ_TENANTS__FILE": str(tenants)}
    worker_only = {**env, **worker_env}
    worker = LlmqProcess("worker", [sys.executable, "-m", "pipeline.cli", "--log-level", "WARNING", "worker",
                                    "--backend", "openai", "--openai-base-url", base_url], worker_only, workdir)
    worker.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    port = free_port()
    serve = LlmqProcess("serve", [sys.executable, "-m", "pipeline.cli", "--log-level", "INFO", "serve", "--port",
                                  str(port)], env, workdir)
    worker.start()
    serve.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if not serve.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"serve did not start:\n{serve.output()[-2000:]}")
        time.sleep(0.3)
    return worker, serve, url


def _batch_file(lines: int, tag: str) -> bytes:
    out = io.StringIO()
    for i in range(lines):
        out.write(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                              "body": {"model": "sim-small", "max_tokens": BATCH_TOKENS,
                                       "messages": [{"role": "user", "content": f"summarise {tag} document {i}"}]}}))
        out.write("\n")
    return out.getvalue().encode()


async def _run_batch(http: httpx.Client, lines: int, tag: str) -> tuple[dict, list[tuple[float, int]], float]:
    """Upload and start a batch, poll it each second until it ends: (last batch object,
    [(epoch s, lines answered)], when it was created)."""
    loop = asyncio.get_running_loop()
    data = _batch_file(lines, tag)
    up = await loop.run_in_executor(None, lambda: http.post("/files", files={"file": (f"{tag}.jsonl", data)},
                                                            data={"purpose": "batch"}))
    up.raise_for_status()
    created = await loop.run_in_executor(None, lambda: http.post("/batches", json={
        "input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
    created.raise_for_status()
    batch_id, started, progress = created.json()["id"], time.time(), []
    while True:
        doc = (await loop.run_in_executor(None, lambda: http.get(f"/batches/{batch_id}"))).json()
        counts = doc["request_counts"]
        progress.append((time.time(), counts["completed"] + counts["failed"]))
        if doc["status"] in ("completed", "failed", "expired", "cancelled"):
            return doc, progress, started
        if time.time() - started > 1200:
            raise RuntimeError(f"the batch did not finish in 20 minutes: {doc}")
        await asyncio.sleep(1.0)


def _preemptions(url: str) -> float | None:
    """llmq_preemptions_total, all bands, from the worker's metrics."""
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llmq_preemptions_total{"))


def _pct(rows: list, column: int, q: float) -> float | None:
    xs = sorted(r[column] for r in rows if r[column] is not None)
    return round(xs[min(len(xs) - 1, int(len(xs) * q))], 1) if xs else None


def _span(progress: list[tuple[float, int]], lines: int, lo: float, hi: float) -> tuple[float, float, float]:
    """(start, end, lines a second) between the first poll with more than ``lo`` of the lines
    answered and the first with at least ``hi``."""
    a = next((t, n) for t, n in progress if n > lo * lines)
    b = next((t, n) for t, n in progress if n >= hi * lines)
    return a[0], b[0], (b[1] - a[1]) / (b[0] - a[0])


class Interactive:
    """Chat requests paced at RATE a second until stopped: (scheduled epoch s, latency ms, in-server ms)."""

    def __init__(self, client):
        self.client = client
        self.results: list[tuple[float, float, float | None, str]] = []
        self._stop = False

    async def _one(self, i: int, scheduled: float) -> None:
        req = Request.new("chat", None, priority=Priority.NORMAL, model="sim-small", max_tokens=INTERACTIVE_TOKENS,
                          timeout_ms=60_000, messages=[{"role": "user", "content": f"hello {i}"}])
        try:
            fut = asyncio.wrap_future(self.client.response_future(req.request_id))
            await self.client.submit(req, wait_queued=0)
            resp = await asyncio.wait_for(fut, 60)
            server = (resp.finished_at - resp.started_at) if resp.started_at and resp.finished_at else None
            self.results.append((scheduled, (time.time() - scheduled) * 1000, server, resp.status.value))
        except Exception:  # noqa: BLE001 (counted: a request sent and not answered)
            self.results.append((scheduled, 60_000.0, None, "UNANSWERED"))
        finally:
            self.client.forget(req.request_id)

    async def run(self) -> None:
        t0, tasks, i = time.time(), [], 0
        while not self._stop:
            scheduled = t0 + i / RATE
            delay = scheduled - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(self._one(i, scheduled)))
            i += 1
        await asyncio.gather(*tasks)

    def stop(self) -> None:
        self._stop = True

    def window(self, start: float, end: float) -> list[tuple[float, float, float | None, str]]:
        """The requests scheduled in [start, end)."""
        return [r for r in self.results if start <= r[0] < end]


def _round(settings: Settings, workdir: Path, worker_env: dict[str, str]) -> dict:
    s = fresh(settings)
    sim = SimulatorProcess("--served-model-name", "sim-small", "--max-num-seqs", str(SLOTS), "--ttft-ms", str(TTFT_MS),
                           "--ms-per-token", str(MS_PER_TOKEN), "--batch-slowdown", "0")
    worker = serve = None
    try:
        worker, serve, url = _processes(s, workdir, sim.base_url, worker_env)
        http = httpx.Client(base_url=f"{url}/v1", headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        sampler = TimedSampler(sim)

        async def run() -> dict:
            from pipeline.client import AsyncLlmqClient

            client = AsyncLlmqClient(s)
            chat = Interactive(client)
            sender = asyncio.ensure_future(chat.run())
            try:
                await asyncio.sleep(WARM_S)
                alone = (time.time(), time.time() + ALONE_S)
                await asyncio.sleep(ALONE_S)
                sampler.start()
                serve_cpu0 = cpu_s(serve.proc.pid)
                beside = await _run_batch(http, LINES, "beside")
                serve_cpu = cpu_s(serve.proc.pid) - serve_cpu0
                preempted = _preemptions(worker.metrics_url)
                chat.stop()
                await sender
                capacity = await _run_batch(http, CAPACITY_LINES, "alone")
                return {"alone": alone, "beside": beside, "capacity": capacity, "chat": chat, "serve_cpu_s": serve_cpu,
                        "preempted": preempted}
            finally:
                chat.stop()
                await client.close()

        got = asyncio.run(run())
        samples = sampler.stop()
        worker_cpu = cpu_s(worker.proc.pid)
    finally:
        for proc in (serve, worker):
            if proc is not None:
                proc.terminate(30)
        sim.stop()
        drop_topics(s)
    chat = got["chat"]
    doc, progress, started = got["beside"]
    first, last, batch_rate = _span(progress, LINES, 0.0, 0.95)
    _, _, capacity = _span(got["capacity"][1], CAPACITY_LINES, 0.1, 0.9)
    alone = chat.window(*got["alone"])
    during = chat.window(first, last)
    alone_p99, during_p99 = p99([r[1] for r in alone]), p99([r[1] for r in during])
    chat_rate = len(during) / (last - first)
    busy = [min(r, SLOTS) / SLOTS for t, r, _ in samples if first <= t < last]
    waiting = [w for t, _, w in samples if first <= t < last]
    out = {
        "batch_status": doc["status"], "request_counts": doc["request_counts"],
        "batch_seconds": round(progress[-1][0] - started, 1),
        "interactive_p99_alone_ms": round(alone_p99, 1), "interactive_p99_beside_batch_ms": round(during_p99, 1),
        "interactive_p50_alone_ms": round(statistics.median(r[1] for r in alone), 1),
        "interactive_p50_beside_batch_ms": round(statistics.median(r[1] for r in during), 1),
        "interactive_p99_ratio": round(during_p99 / alone_p99, 3),
        "interactive_sent": len(chat.results),
        "interactive_not_completed": sum(r[3] != Status.COMPLETED.value for r in chat.results),
        "interactive_in_server_p50_alone_ms": _pct(alone, 2, 0.5), "interactive_in_server_p99_alone_ms": _pct(alone, 2, 0.99),
        "interactive_in_server_p50_beside_ms": _pct(during, 2, 0.5),
        "interactive_in_server_p99_beside_ms": _pct(during, 2, 0.99),
        "preemptions_beside_batch": got["preempted"],
        "interactive_rate": round(chat_rate, 2), "batch_lines_per_s": round(batch_rate, 2),
        "capacity_lines_per_s": round(capacity, 2), "leftover_lines_per_s": round(capacity - chat_rate, 2),
        "batch_share_of_leftover": round(batch_rate / (capacity - chat_rate), 3),
        "slot_busy_fraction": round(statistics.fmean(busy), 4) if busy else None,
        "server_waiting_p50": _pct([(w,) for w in waiting], 0, 0.5), "server_waiting_p99": _pct([(w,) for w in waiting], 0, 0.99),
        "worker_cpu_ms_per_request": round(worker_cpu * 1000 / (len(chat.results) + LINES + CAPACITY_LINES), 3),
        "serve_cpu_ms_per_batch_line": round(got["serve_cpu_s"] * 1000 / LINES, 3),
    }
    _log(f"  batch_beside_interactive: {out}")
    return out


#: Side by side in alternating rounds: the shipped defaults, and the worker with preemption off.
MODES = {"defaults": {}, "preemption_off": {"LLMQ_WORKER__PREEMPT_BANDS": ""}}


def batch_beside_interactive(settings: Settings, args) -> dict:
    rounds = max(1, min(getattr(args, "rounds", 1), 2))
    per: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="llmq-batch-") as tmp:
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                _log(f"  batch_beside_interactive round {r + 1}, {mode}")
                per[mode].append(_round(settings, Path(tmp) / f"{mode}{r}", MODES[mode]))

    def med(rows: list[dict], key: str):
        values = [x[key] for x in rows if isinstance(x.get(key), (int, float))]
        return round(statistics.median(values), 4) if values else None

    first = per["defaults"][0]
    out = {k: med(per["defaults"], k) for k in first if isinstance(first[k], (int, float))}
    out["preemption_off"] = {k: med(per["preemption_off"], k) for k in first if isinstance(first[k], (int, float))}
    out.update({"rounds": per, "targets": TARGET, "overrides": OVERRIDES, "lines": LINES, "rate": RATE,
                "conditions": f"simulator {SLOTS} slots, {TTFT_MS} ms prefill, {MS_PER_TOKEN} ms a decode step, no "
                              f"batch slowdown; answers of {TOKENS} tokens; interactive NORMAL chat at {RATE}/s "
                              f"through the SDK; a {LINES}-line BACKGROUND batch through the Batch API of one llmq "
                              f"serve; one llmq worker on the request topics; {ALONE_S:.0f} s of interactive alone "
                              "first; figures while lines wait (first answer to 95 % answered); capacity: a "
                              f"{CAPACITY_LINES}-line batch alone, 10 % to 90 % answered"})
    return out
