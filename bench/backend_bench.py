"""Model servers kept busy in llmq's order, and time to first token through llmq.

Both scenarios run against the project's vLLM-like simulator (``python -m pipeline.simulator``:
continuous batching over ``max_num_seqs`` slots, its own first-come-first-served waiting queue,
``vllm:num_requests_running``/``waiting`` on /metrics) as a server process, and an ``llmq worker``
process with the OpenAI backend, reading the request topics.

* ``backend_utilization``: 16 slots, 20 ms to first token, 5 ms per token, 64-token answers.
  A BACKGROUND backlog kept at 3x the slots; a streamed CRITICAL request every half second.
  Side by side, alternating rounds: llmq's pacing (metrics-driven in-flight limit) against the
  naive setting (64 in flight, no adaptation), preemption off in both so pacing alone is
  measured. Reported: the share of slots busy, the server's waiting queue, and how long CRITICAL
  waited (its time to first token less an idle one), against one request's service time.
* ``streaming_ttft``: 100 then 200 streams per second, each straight to the simulator and through llmq
  (SDK -> request topic -> worker -> simulator -> chunk records -> SDK), alternating rounds;
  reported: p50/p99 time to first token of each, and what llmq adds.

Run alone: ``python bench/run.py backend_utilization streaming_ttft``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from confluent_kafka import Producer
from failover_bench import LlmqProcess, TopicWatch  # bench/, beside this script
from gateway_bench import drop_topics, fresh, p99, records_written

from pipeline.config import Settings
from pipeline.models import Priority, Request
from pipeline.serde import Codec
from pipeline.simulator.process import SimulatorProcess
from pipeline.testing import produce_request

SLOTS, TTFT_MS, MS_PER_TOKEN, TOKENS = 16, 20, 5, 64
#: BACKGROUND answers vary in length around TOKENS, as real ones do. With one length for all,
#: requests that join in one engine step finish in one step, for ever, and each such cohort's
#: replacements wait together for the next step: a wait the workload makes, not the pacing.
TOKENS_SPREAD = (TOKENS // 2, TOKENS * 3 // 2)
BACKLOG = 3 * SLOTS
WARM_S, MEASURE_S, CRITICAL_EVERY_S = 4.0, 20.0, 0.5
TARGET = {"slot_busy_fraction": 0.97, "server_waiting_p99": 2, "critical_wait_p99_over_service": 1.5,
          "added_p99_ms": 15.0}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _worker(settings: Settings, workdir: Path, name: str, base_url: str, *, pacing: bool, max_inflight: int):
    env = {**os.environ, **settings.topology_env(), "LLMQ_WORKER__METRICS_PORT": "0",
           "LLMQ_WORKER__BACKEND_PACING": "true" if pacing else "false", "LLMQ_WORKER__PREEMPT_BANDS": "",
           "LLMQ_WORKER__BACKEND_TIMEOUT_S": "120"}
    argv = [sys.executable, "-m", "pipeline.cli", "--log-level", "WARNING", "worker", "--worker-id", name,
            "--backend", "openai", "--openai-base-url", base_url, "--max-inflight", str(max_inflight)]
    proc = LlmqProcess(name, argv, env, workdir)
    proc.start()
    return proc


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a running process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sampler(threading.Thread):
    """The server's (running, waiting) every 20 ms."""

    def __init__(self, sim: SimulatorProcess):
        super().__init__(name="sim-sampler", daemon=True)
        self.sim, self.samples, self._halt = sim, [], threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.02):
            self.samples.append(self.sim.load())

    def stop(self) -> list[tuple[float, float]]:
        self._halt.set()
        self.join(5)
        return self.samples


class Backlog(threading.Thread):
    """BACKGROUND requests, topped up to ``size`` unanswered, until stopped."""

    def __init__(self, settings: Settings, size: int):
        super().__init__(name="backlog", daemon=True)
        self.settings, self.size = settings, size
        self.sent: set[str] = set()
        self.done: dict[str, object] = {}
        self._halt = threading.Event()
        self._lock = threading.Lock()
        codec = Codec.default()
        self.watch = TopicWatch(settings, [settings.topics.responses], codec.decode_response, self._answered)

    def _answered(self, msg, resp) -> None:
        if resp.status.is_terminal and resp.request_id in self.sent:
            with self._lock:
                self.done[resp.request_id] = resp

    def run(self) -> None:
        codec = Codec.default()
        producer = Producer(self.settings.kafka.producer_config(**{"linger.ms": 1}))
        i = 0
        lengths = random.Random(7)  # the same answer lengths in every round
        while not self._halt.is_set():
            with self._lock:
                missing = self.size - (len(self.sent) - len(self.done))
            for _ in range(missing):
                req = Request.new(f"bulk-{i % 4}", f"job {i}", priority=Priority.BACKGROUND, model="sim-small",
                                  max_tokens=lengths.randint(*TOKENS_SPREAD), timeout_ms=600_000)
                with self._lock:
                    self.sent.add(req.request_id)
                produce_request(producer, self.settings, codec, req)
                i += 1
            producer.poll(0)
            self._halt.wait(0.01)
        producer.flush(30)

    def start(self) -> None:
        self.watch.start()
        super().start()

    def stop(self) -> None:
        if self._halt.is_set():
            return
        self._halt.set()
        if self.is_alive():
            self.join(30)
        if self.watch.is_alive():
            self.watch.stop()


async def _first_token_ms(client, priority: Priority, tag: str) -> float | None:
    """A streamed request; ms from its submission to its first chunk (None: no chunk came)."""
    req = Request.new("urgent", tag, priority=priority, model="sim-small", max_tokens=TOKENS, timeout_ms=120_000)
    t0 = time.monotonic()
    first = None
    async with client.stream(req, timeout=120) as stream:
        async for chunk in stream:
            if first is None and chunk.delta:
                first = (time.monotonic() - t0) * 1000
    return first


def _utilization_round(settings: Settings, mode: str, workdir: Path) -> dict:
    s = fresh(settings)
    sim = SimulatorProcess("--served-model-name", "sim-small", "--max-num-seqs", str(SLOTS), "--ttft-ms", str(TTFT_MS),
                    "--ms-per-token", str(MS_PER_TOKEN))
    worker = _worker(s, workdir, f"{mode}-worker", sim.base_url, pacing=mode == "llmq",
                     max_inflight=64)
    backlog = Backlog(s, BACKLOG)
    try:
        from pipeline.client import AsyncLlmqClient

        async def run() -> tuple[list[float], list[float | None]]:
            client = AsyncLlmqClient(s)
            try:
                # Idle first: what a CRITICAL stream takes with nothing ahead of it (and the worker ready).
                idle = [await _first_token_ms(client, Priority.CRITICAL, f"idle {i}") for i in range(6)]
                backlog.start()
                await asyncio.sleep(WARM_S)
                sampler.start()
                tasks = []
                for i in range(int(MEASURE_S / CRITICAL_EVERY_S)):
                    tasks.append(asyncio.ensure_future(_first_token_ms(client, Priority.CRITICAL, f"now {i}")))
                    await asyncio.sleep(CRITICAL_EVERY_S)
                return [x for x in idle[1:] if x is not None], await asyncio.gather(*tasks)
            finally:
                await client.close()

        sampler = Sampler(sim)
        idle, critical = asyncio.run(run())
        samples = sampler.stop()
        backlog.stop()
        answered = len(backlog.done) + len(critical) + 6
        worker_cpu = cpu_s(worker.proc.pid)
        written = records_written(s, answered)
    finally:
        backlog.stop()
        worker.terminate(30)
        sim.stop()
        drop_topics(s)
    idle_ms = statistics.median(idle)
    waits = sorted(max(0.0, c - idle_ms) if c is not None else 120_000.0 for c in critical)
    service = [r.finished_at - r.started_at for r in backlog.done.values()
               if r.finished_at and r.started_at and r.status.value == "COMPLETED"]
    running = [min(r, SLOTS) for r, _ in samples]
    waiting = sorted(w for _, w in samples)
    # What waits with no slot free for it at the next step: the calls whose order the server, not llmq, decides.
    queued = sorted(max(0.0, w - max(0.0, SLOTS - r)) for r, w in samples)
    out = {"slot_busy_fraction": round(statistics.fmean(running) / SLOTS, 4) if running else 0.0,
           "server_waiting_p50": waiting[len(waiting) // 2] if waiting else None,
           "server_waiting_p99": p99(waiting), "server_queued_past_free_slots_p99": p99(queued),
           "critical_idle_ttft_ms": round(idle_ms, 1),
           "critical_wait_p50_ms": round(waits[len(waits) // 2], 1), "critical_wait_p99_ms": round(p99(waits), 1),
           "critical_unanswered": sum(c is None for c in critical),
           "background_answered": len(backlog.done),
           "in_server_ms_p50": round(statistics.median(service), 1) if service else None, "samples": len(samples),
           "worker_cpu_ms_per_request": round(worker_cpu * 1000 / answered, 3),
           "broker_records_per_answer": written["records_per_admitted"],
           "broker_bytes_per_answer": written["bytes_per_admitted"]}
    _log(f"  backend_utilization {mode}: {out}")
    return out


def backend_utilization(settings: Settings, args) -> dict:
    rounds = max(1, min(getattr(args, "rounds", 2), 2))
    per: dict[str, list[dict]] = {"llmq": [], "naive": []}
    with tempfile.TemporaryDirectory(prefix="llmq-backend-") as tmp:
        for r in range(rounds):
            for mode in ("llmq", "naive") if r % 2 == 0 else ("naive", "llmq"):
                per[mode].append(_utilization_round(settings, mode, Path(tmp) / f"{mode}{r}"))

    def med(mode: str, key: str):
        values = [x[key] for x in per[mode] if x.get(key) is not None]
        return round(statistics.median(values), 4) if values else None

    # One request's time in the server when nothing queues there: llmq's rounds (the naive ones
    # count the server's queue in it).
    service_ms = med("llmq", "in_server_ms_p50")
    out: dict = {"slots": SLOTS, "ttft_ms": TTFT_MS, "ms_per_token": MS_PER_TOKEN, "tokens": TOKENS,
                 "backlog": BACKLOG, "rounds": rounds, "service_ms": service_ms}
    for mode in per:
        out[mode] = {k: med(mode, k) for k in per[mode][0] if isinstance(per[mode][0][k], (int, float))}
        out[mode]["critical_wait_p99_over_service"] = (round(out[mode]["critical_wait_p99_ms"] / service_ms, 3)
                                                       if service_ms else None)
        out[mode]["rounds"] = per[mode]
    llmq, naive = out["llmq"], out["naive"]
    out.update({"slot_busy_fraction": llmq["slot_busy_fraction"], "server_waiting_p99": llmq["server_waiting_p99"],
                "critical_wait_p99_ms": llmq["critical_wait_p99_ms"],
                "critical_wait_p99_over_service": llmq["critical_wait_p99_over_service"],
                "naive_critical_wait_p99_ms": naive["critical_wait_p99_ms"],
                "naive_over_llmq_critical_wait_p99": (round(naive["critical_wait_p99_ms"] / llmq["critical_wait_p99_ms"], 2)
                                                      if llmq["critical_wait_p99_ms"] else None),
                "targets": {k: TARGET[k] for k in ("slot_busy_fraction", "server_waiting_p99",
                                                   "critical_wait_p99_over_service")},
                "conditions": f"simulator {SLOTS} slots, {TTFT_MS} ms to first token, {MS_PER_TOKEN} ms/token, "
                              f"answers of {TOKENS_SPREAD[0]}-{TOKENS_SPREAD[1]} tokens (CRITICAL's {TOKENS}); one llmq worker process on the request topics, preemption "
                              f"off; BACKGROUND backlog kept at {BACKLOG}; a streamed CRITICAL request every "
                              f"{CRITICAL_EVERY_S} s for {MEASURE_S:.0f} s after {WARM_S:.0f} s of warm-up; "
                              "CRITICAL wait = its time to first token less the median idle one; naive = "
                              "64 in flight, no pacing"})
    return out


# -- streaming_ttft ---------------------------------------------------------------------------

STREAM_RATES, STREAM_TOKENS, STREAM_SECONDS, STREAM_TTFT_MS = (100, 200), 16, 8.0, 2


async def _paced_streams(open_one, rate: int, seconds: float) -> list[float | None]:
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.2
    tasks = []
    for i in range(int(rate * seconds)):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(open_one(i)))
    return await asyncio.gather(*tasks, return_exceptions=False)


def _has_text(line: str) -> bool:
    """Whether an SSE line carries generated text (not the opening role-only chunk, not [DONE])."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def _direct_round(base_url: str, rate: int, seconds: float) -> list[float | None]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        async def one(i: int) -> float | None:
            t0 = time.monotonic()
            body = {"model": "sim-small", "messages": [{"role": "user", "content": f"direct {i}"}],
                    "max_tokens": STREAM_TOKENS, "stream": True}
            first = None
            try:
                async with http.stream("POST", f"{base_url}/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if first is None and _has_text(line):
                            first = (time.monotonic() - t0) * 1000
            except httpx.HTTPError:
                return None
            return first

        return await _paced_streams(one, rate, seconds)


async def _llmq_round(client, rate: int, seconds: float) -> list[float | None]:
    async def one(i: int) -> float | None:
        req = Request.new(f"t{i % 20}", f"through llmq {i}", priority=Priority.HIGH, model="sim-small",
                          max_tokens=STREAM_TOKENS, timeout_ms=60_000)
        t0 = time.monotonic()
        first = None
        try:
            async with client.stream(req, timeout=60) as stream:
                async for chunk in stream:
                    if first is None and chunk.delta:
                        first = (time.monotonic() - t0) * 1000
        except Exception:  # noqa: BLE001 (counted as unanswered)
            return None
        return first

    return await _paced_streams(one, rate, seconds)


def _ttft_stats(xs: list[float | None], skip: int) -> dict:
    kept = xs[skip:]
    got = sorted(x for x in kept if x is not None)
    return {"p50_ms": round(got[len(got) // 2], 2) if got else None, "p99_ms": round(p99(got), 2) if got else None,
            "streams": len(kept), "no_first_token": sum(x is None for x in kept)}


def streaming_ttft(settings: Settings, args) -> dict:
    """At each rate in STREAM_RATES (the issue's is the last), alternating direct and llmq rounds."""
    rounds = max(1, min(getattr(args, "rounds", 2), 3))
    seconds = STREAM_SECONDS
    s = fresh(settings)
    # Sized so that the rates do not saturate the server itself: each joiner's prefill costs
    # the whole batch a step, so 20 ms of it at 200 joiners/s would be 4 s of work a second.
    sim = SimulatorProcess("--served-model-name", "sim-small", "--max-num-seqs", "256", "--ttft-ms",
                           str(STREAM_TTFT_MS), "--batch-slowdown", "0", "--ms-per-token", str(MS_PER_TOKEN))
    per: dict[int, dict[str, list[dict]]] = {rate: {"direct": [], "llmq": []} for rate in STREAM_RATES}
    cpu: dict[int, list[float]] = {rate: [] for rate in STREAM_RATES}
    with tempfile.TemporaryDirectory(prefix="llmq-ttft-") as tmp:
        worker = _worker(s, Path(tmp), "ttft-worker", sim.base_url, pacing=True, max_inflight=256)
        try:
            from pipeline.client import AsyncLlmqClient

            async def run() -> None:
                client = AsyncLlmqClient(s)
                try:
                    await _llmq_round(client, 20, 1.0)  # the worker ready, the pacer warmed
                    await _direct_round(sim.base_url, 20, 1.0)
                    for rate in STREAM_RATES:
                        for r in range(rounds):
                            for path in ("direct", "llmq") if r % 2 == 0 else ("llmq", "direct"):
                                before = cpu_s(worker.proc.pid)
                                xs = await (_direct_round(sim.base_url, rate, seconds) if path == "direct"
                                            else _llmq_round(client, rate, seconds))
                                per[rate][path].append(_ttft_stats(xs, rate))  # the first second dropped
                                if path == "llmq":
                                    cpu[rate].append((cpu_s(worker.proc.pid) - before) * 1000 / len(xs))
                                _log(f"  streaming_ttft {rate}/s round {r} {path}: {per[rate][path][-1]}")
                                await asyncio.sleep(2.0)  # what is left drains before the next round
                finally:
                    await client.close()

            asyncio.run(run())
        finally:
            worker.terminate(30)
            sim.stop()
            drop_topics(s)
    by_rate = {}
    for rate, paths in per.items():
        med = {path: {k: statistics.median(r[k] for r in rs if r[k] is not None) for k in ("p50_ms", "p99_ms")}
               for path, rs in paths.items()}
        by_rate[str(rate)] = {
            "added_p50_ms": round(med["llmq"]["p50_ms"] - med["direct"]["p50_ms"], 2),
            "added_p99_ms": round(med["llmq"]["p99_ms"] - med["direct"]["p99_ms"], 2),
            "worker_cpu_ms_per_stream": round(statistics.median(cpu[rate]), 3),
            "direct": {**med["direct"], "rounds": paths["direct"]}, "llmq": {**med["llmq"], "rounds": paths["llmq"]}}
    top = by_rate[str(STREAM_RATES[-1])]
    return {"rate_per_s": STREAM_RATES[-1], "seconds_per_round": seconds, "rounds": rounds, "tokens": STREAM_TOKENS,
            "added_p50_ms": top["added_p50_ms"], "added_p99_ms": top["added_p99_ms"],
            "target_added_p99_ms": TARGET["added_p99_ms"], "within_target": top["added_p99_ms"] <= TARGET["added_p99_ms"],
            "worker_cpu_ms_per_stream": top["worker_cpu_ms_per_stream"], "by_rate": by_rate,
            "conditions": f"simulator 256 slots, {STREAM_TTFT_MS} ms prefill per joiner, {MS_PER_TOKEN} ms/token, no "
                          f"batch slowdown; {STREAM_TOKENS}-token streamed answers at "
                          f"{', '.join(map(str, STREAM_RATES))} streams/s; one llmq worker process (pacing on, "
                          "256 in flight) on the request topics; the streams, straight (httpx) and through the "
                          "SDK (AsyncLlmqClient), opened from this process; first second of each round dropped; "
                          "all on one 2-core machine with the broker"}
