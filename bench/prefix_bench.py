"""``prefix_routing``: four prefix-caching model servers behind llmq, routed by cache or not.

Four simulator processes (``python -m pipeline.simulator``: vLLM's automatic prefix caching,
16-token blocks, prefill paid only for uncached blocks, ``vllm:prefix_cache_*`` counters), and
``llmq worker`` processes with the OpenAI backend over all four, reading the request topics.
Closed-loop users (more than the servers' slots, so they are saturated) each run conversations
of ``TURNS`` turns over one of ``SYSTEMS`` shared system prompts, every turn resending the
history, plus a share of one-off prompts; each turn is streamed through llmq (SDK -> request
topic -> worker -> simulator -> chunks -> SDK) and its time to first token measured there. Each
request takes a tenant at random, so one conversation's turns land on different partitions
and, with two workers, on different workers.

Side by side in each round (fresh servers and topics for each run):

* ``least_loaded``: ``worker.backend_prefix_affinity = false``, today's spreading;
* ``prefix``: routing by cache (the default), one worker;
* ``prefix_two_workers``: two workers in one group in front of the same four servers;
* the oracle: the hit ratio if a block counted as a hit whenever any server had ever been
  sent it (computed from the prompts each run sent, without eviction);
* ``one_off_*``: one-off prompts only (no shared prefix), least-loaded and prefix-aware.

Reported per run: the servers' block hit ratio (tokens found cached over tokens looked up, from
their counters), the oracle's, TTFT p50/p99 of first and of later turns, answers per second
(throughput at saturation), requests per server max over mean, the worker's CPU per request;
and a micro-benchmark of one routing decision (key, choice, record). Medians over rounds.

Run alone: ``python bench/run.py --rounds 3 prefix_routing``.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from backend_bench import cpu_s  # bench/, beside this script
from failover_bench import LlmqProcess
from gateway_bench import drop_topics, fresh, p99

from pipeline.config import Settings
from pipeline.models import Priority, Request
from pipeline.simulator.prefix_cache import BLOCK_TOKENS, block_hashes, reusable_blocks
from pipeline.simulator.process import SimulatorProcess
from pipeline.simulator.text import count_prompt_tokens

SERVERS, SLOTS = 4, 4
TTFT_MS, MS_PER_TOKEN, PREFILL_MS_PER_TOKEN, TOKENS = 5, 10, 0.2, 8
#: Closed-loop users who think (exponentially, THINK_S on average) between turns, as chat users
#: do: enough for the slots to be about 80 % busy under least-loaded routing (what a turn's time to
#: first token is measured at), and twice as many (saturation: throughput). Without thinking, a
#: user's next turn would take the slot its last turn just freed, whatever the routing.
USERS, SATURATING_USERS, THINK_S = 3 * SERVERS * SLOTS, 6 * SERVERS * SLOTS, 1.0
TURNS, SYSTEMS, ONE_OFF_SHARE = 5, 4, 0.15
FIRST_TURN_WORDS, LATER_TURN_WORDS = 500, 30
WARM_S = 6.0
MEASURE_S = float(os.environ.get("LLMQ_PREFIX_BENCH_MEASURE_S", "20"))
TARGET = {"hit_ratio_over_oracle": 0.9, "later_ttft_p50_ratio": 0.5, "throughput_ratio": 1.3,
          "requests_max_over_mean": 1.25, "one_off_ttft_p99_ratio": 1.05, "two_workers_hit_over_oracle": 0.85,
          "decision_us": 50.0}
#: The servers' KV cache, tokens (default: max_num_seqs x max_model_len, as the simulator's).
_KV_TOKENS = os.environ.get("LLMQ_PREFIX_BENCH_KV_TOKENS", "")
_KV = ("--kv-cache-tokens", _KV_TOKENS) if _KV_TOKENS else ()
_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
          "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


SYSTEM_PROMPTS = [f"System {i}: " + _text(random.Random(i), 300) for i in range(SYSTEMS)]


def _rendered(messages: list[dict]) -> str:
    """The prompt as the simulator renders a chat (its blocks are cut from this)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


class Oracle:
    """Hits if every block ever sent to any server were still cached on the one a request reaches."""

    def __init__(self):
        self.seen: set[int] = set()
        self.hits = self.queries = 0

    def sent(self, messages: list[dict], counted: bool) -> None:
        prompt = _rendered(messages)
        blocks = block_hashes(prompt)
        matched = 0
        for b in blocks:
            if b not in self.seen:
                break
            matched += 1
        self.seen.update(blocks)
        if counted:
            tokens = count_prompt_tokens(prompt)
            self.hits += reusable_blocks(matched, tokens) * BLOCK_TOKENS
            self.queries += tokens


_COUNTER = re.compile(r"^(vllm:[a-z_]+_total)(?:\{[^}]*\})? ([0-9.e+-]+)$", re.MULTILINE)


def _counters(sims: list[SimulatorProcess]) -> list[dict[str, float]]:
    out = []
    for sim in sims:
        text = httpx.get(f"http://127.0.0.1:{sim.port}/metrics", timeout=5).text
        values: dict[str, float] = {}
        for name, value in _COUNTER.findall(text):
            values[name] = values.get(name, 0.0) + float(value)
        out.append(values)
    return out


def _worker(s: Settings, workdir: Path, name: str, urls: list[str], affinity: bool) -> LlmqProcess:
    env = {**os.environ, **s.topology_env(), "LLMQ_WORKER__METRICS_PORT": "0", "LLMQ_WORKER__PREEMPT_BANDS": "",
           "LLMQ_WORKER__BACKEND_TIMEOUT_S": "120", "LLMQ_WORKER__OPENAI_ROUTES": "*=" + ",".join(urls),
           "LLMQ_WORKER__BACKEND_PREFIX_AFFINITY": "true" if affinity else "false"}
    argv = [sys.executable, "-m", "pipeline.cli", "--log-level", "WARNING", "worker", "--worker-id", name,
            "--backend", "openai", "--max-inflight", "64"]
    proc = LlmqProcess(name, argv, env, workdir)
    proc.start()
    return proc


async def _users(client, one_off_only: bool, oracle: Oracle, measure_from: float, stop_at: float,
                 seed: int, users: int) -> list[tuple[int, float, float]]:
    """Closed-loop users until ``stop_at``; returns (turn, ttft_ms, answered_at) of measured requests."""
    out: list[tuple[int, float, float]] = []

    async def user(u: int) -> None:
        rng = random.Random(seed * 1000 + u)
        while time.monotonic() < stop_at:
            one_off = one_off_only or rng.random() < ONE_OFF_SHARE
            if one_off:
                messages = [{"role": "user", "content": f"one-off {u} {rng.random()}: " + _text(rng, 250)}]
                turns = 1
            else:
                messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
                turns = TURNS
            for turn in range(1, turns + 1):
                await asyncio.sleep(rng.expovariate(1.0 / THINK_S))
                if time.monotonic() >= stop_at:
                    return
                if not one_off:
                    # The first turn brings its material (a document, code, a tool's output), the
                    # later ones short follow-ups: the history is mostly the conversation's own.
                    words = FIRST_TURN_WORDS if turn == 1 else LATER_TURN_WORDS
                    messages.append({"role": "user", "content": f"turn {turn} of {u}: " + _text(rng, words)})
                req = Request.new(f"t{rng.randrange(16)}", None, messages=[dict(m) for m in messages],
                                  model="sim-small", priority=Priority.NORMAL, max_tokens=TOKENS, timeout_ms=120_000)
                sent = time.monotonic()
                oracle.sent(messages, sent >= measure_from)
                first, text = None, []
                try:
                    async with client.stream(req, timeout=120) as stream:
                        async for chunk in stream:
                            if chunk.delta:
                                if first is None:
                                    first = (time.monotonic() - sent) * 1000
                                text.append(chunk.delta)
                except Exception as exc:  # noqa: BLE001 (counted as unanswered, the run goes on)
                    _log(f"  a request failed: {type(exc).__name__}: {exc}")
                    out.append((turn, float("nan"), time.monotonic()))
                    continue
                if sent >= measure_from and first is not None:
                    out.append((turn, first, time.monotonic()))
                messages.append({"role": "assistant", "content": "".join(text)})

    await asyncio.gather(*(user(u) for u in range(users)))
    return out


def _run(settings: Settings, workdir: Path, mode: str, seed: int) -> dict:
    s = fresh(settings)
    sims = [SimulatorProcess("--served-model-name", "sim-small", "--max-num-seqs", str(SLOTS), "--ttft-ms",
                             str(TTFT_MS), "--ms-per-token", str(MS_PER_TOKEN), "--prefill-ms-per-token",
                             str(PREFILL_MS_PER_TOKEN), "--max-model-len", "8192", *_KV) for _ in range(SERVERS)]
    affinity = not mode.endswith("least_loaded")
    users = SATURATING_USERS if mode.startswith("saturated") else USERS
    workers = [_worker(s, workdir, f"{mode}-{i}", [x.base_url for x in sims], affinity)
               for i in range(2 if mode == "prefix_two_workers" else 1)]
    oracle = Oracle()
    try:
        from pipeline.client import AsyncLlmqClient

        async def go():
            client = AsyncLlmqClient(s)
            try:
                # The workers up and assigned: one request each way before the clock starts.
                warm = Request.new("warm", "hello", model="sim-small", max_tokens=1, timeout_ms=120_000)
                async with client.stream(warm, timeout=120) as stream:
                    async for _ in stream:
                        pass
                now = time.monotonic()
                measure_from, stop_at = now + WARM_S, now + WARM_S + MEASURE_S
                task = asyncio.ensure_future(_users(client, mode.startswith("one_off"), oracle, measure_from,
                                                    stop_at, seed, users))
                await asyncio.sleep(max(0.0, measure_from - time.monotonic()))
                before = (_counters(sims), sum(cpu_s(w.proc.pid) for w in workers), time.monotonic())
                busy = []

                def sample() -> None:
                    while time.monotonic() < stop_at:
                        busy.append(sum(min(SLOTS, sim.load()[0]) for sim in sims) / (SERVERS * SLOTS))
                        time.sleep(0.1)

                sampler = asyncio.get_running_loop().run_in_executor(None, sample)
                results = await task
                after = (_counters(sims), sum(cpu_s(w.proc.pid) for w in workers), time.monotonic())
                await sampler
                return results, before, after, busy
            finally:
                await client.close()

        results, before, after, busy = asyncio.run(go())
    finally:
        for w in workers:
            w.terminate(30)
        for sim in sims:
            sim.stop()
        drop_topics(s)
    (c0, cpu0, t0), (c1, cpu1, t1) = before, after

    def delta(name: str) -> list[float]:
        return [b.get(name, 0.0) - a.get(name, 0.0) for a, b in zip(c0, c1)]

    hits, queries = sum(delta("vllm:prefix_cache_hits_total")), sum(delta("vllm:prefix_cache_queries_total"))
    per_server = delta("vllm:request_success_total")
    answered = [r for r in results if r[1] == r[1]]
    first = sorted(ms for turn, ms, _ in answered if turn == 1)
    later = sorted(ms for turn, ms, _ in answered if turn > 1)

    def q(xs, p):
        return round(xs[min(len(xs) - 1, int(len(xs) * p))], 1) if xs else None

    mean = statistics.fmean(per_server) if per_server else 0
    out = {"users": users, "slot_busy_fraction": round(statistics.fmean(busy), 3) if busy else None,
           "hit_ratio": round(hits / queries, 4) if queries else None,
           "oracle_hit_ratio": round(oracle.hits / oracle.queries, 4) if oracle.queries else None,
           "first_ttft_p50_ms": q(first, 0.5), "first_ttft_p99_ms": round(p99(first), 1) if first else None,
           "later_ttft_p50_ms": q(later, 0.5), "later_ttft_p99_ms": round(p99(later), 1) if later else None,
           "ttft_p99_ms": round(p99(first + later), 1) if answered else None,
           "answers_per_s": round(len(answered) / (t1 - t0), 2),
           "requests_max_over_mean": round(max(per_server) / mean, 3) if mean else None,
           "requests_per_server": [int(x) for x in per_server],
           "failed": len(results) - len(answered),
           "worker_cpu_ms_per_request": round((cpu1 - cpu0) * 1000 / max(1, len(answered)), 3)}
    if out["hit_ratio"] is not None and out["oracle_hit_ratio"]:
        out["hit_over_oracle"] = round(out["hit_ratio"] / out["oracle_hit_ratio"], 3)
    _log(f"  prefix_routing {mode}: {out}")
    return out


def decision_cost_us(n: int = 3000) -> dict:
    """One routing decision (prompt key, choice over four servers, record), in microseconds."""
    from types import SimpleNamespace

    from pipeline.worker.backends.affinity import AffinityConfig, PrefixAffinity, prompt_key

    servers = [f"http://10.0.0.{i}:8000/v1" for i in range(SERVERS)]
    aff = PrefixAffinity(AffinityConfig(), name=str)
    rng = random.Random(1)

    def chat(c: int, turns: int):
        messages = [{"role": "system", "content": SYSTEM_PROMPTS[c % SYSTEMS]}]
        for t in range(turns):
            messages += [{"role": "user", "content": _text(rng, 100)}, {"role": "assistant", "content": _text(rng, 8)}]
        return SimpleNamespace(model="sim-small", messages=messages[:-1], prompt=None, request_id=f"r{c}", metadata={})

    out = {}
    for label, turns in (("five_turns", TURNS), ("forty_turns", 40)):
        requests = [chat(c, turns) for c in range(200)]
        loads = {s: float(i) for i, s in enumerate(servers)}
        times = []
        for i in range(n):
            req = requests[i % len(requests)]
            t = time.perf_counter()
            key = prompt_key(req, aff.config)
            choice = aff.choose(key, servers, loads.__getitem__, lambda s: 2, float(i), req.request_id)
            if choice.server is not None:
                aff.record(choice.server, key, float(i))
            times.append(time.perf_counter() - t)
        times.sort()
        chars = statistics.fmean(len(_rendered(r.messages)) for r in requests)
        out[label] = {"p50_us": round(times[len(times) // 2] * 1e6, 1), "p99_us": round(p99(times) * 1e6, 1),
                      "prompt_chars": round(chars)}
    return out


MODES = tuple(os.environ.get("LLMQ_PREFIX_BENCH_MODES", "").split(",")) if os.environ.get(
    "LLMQ_PREFIX_BENCH_MODES") else ("least_loaded", "prefix", "prefix_two_workers", "one_off_least_loaded",
                                     "one_off_prefix", "saturated_least_loaded", "saturated_prefix")


def prefix_routing(settings: Settings, args) -> dict:
    rounds = max(1, min(getattr(args, "rounds", 3), 3))
    per: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="llmq-prefix-") as tmp:
        for r in range(rounds):
            order = MODES if r % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                per[mode].append(_run(settings, Path(tmp) / f"{mode}{r}", mode, seed=r))

    def med(mode: str, key: str):
        values = [x[key] for x in per[mode] if x.get(key) is not None]
        return round(statistics.median(values), 4) if values else None

    out: dict = {"rounds": rounds, "decision": decision_cost_us()}
    for mode in MODES:
        out[mode] = {k: med(mode, k) for k in per[mode][0] if isinstance(per[mode][0][k], (int, float))}
        out[mode]["rounds"] = per[mode]
    ll, px, two, oll, opx, sll, spx = (out.get(m, {}) for m in (
        "least_loaded", "prefix", "prefix_two_workers", "one_off_least_loaded", "one_off_prefix",
        "saturated_least_loaded", "saturated_prefix"))

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    out["figures"] = {
        "hit_ratio_over_oracle": px.get("hit_over_oracle"),
        "least_loaded_hit_over_oracle": ll.get("hit_over_oracle"),
        "later_ttft_p50_ratio": ratio(px.get("later_ttft_p50_ms"), ll.get("later_ttft_p50_ms")),
        "throughput_ratio": ratio(spx.get("answers_per_s"), sll.get("answers_per_s")),
        "requests_max_over_mean": px.get("requests_max_over_mean"),
        "one_off_ttft_p99_ratio": ratio(opx.get("ttft_p99_ms"), oll.get("ttft_p99_ms")),
        "two_workers_hit_over_oracle": two.get("hit_over_oracle"),
        "decision_us": out["decision"]["five_turns"]["p50_us"],
        "cpu_per_request_ratio": ratio(px.get("worker_cpu_ms_per_request"), ll.get("worker_cpu_ms_per_request")),
    }
    out["targets"] = TARGET
    out["conditions"] = (f"{SERVERS} simulator processes, {SLOTS} slots each, {TTFT_MS} ms per joiner + "
                         f"{PREFILL_MS_PER_TOKEN} ms per uncached prompt token, {MS_PER_TOKEN} ms/token, "
                         f"{TOKENS}-token answers; {USERS} closed-loop users ({SATURATING_USERS} for saturation), "
                         f"conversations of {TURNS} turns over {SYSTEMS} shared system prompts (a first turn of "
                         f"{FIRST_TURN_WORDS} words, "
                         f"follow-ups of {LATER_TURN_WORDS}, thinking {THINK_S:g} s on average between turns), "
                         f"{ONE_OFF_SHARE:.0%} one-off prompts; "
                         f"streamed through llmq workers on the request topics; {WARM_S:.0f} s warm-up, "
                         f"{MEASURE_S:.0f} s measured per run; all on one 2-core machine with the broker")
    return out
