"""What a request costs, through the front door: `cpu_per_request` and `load_curve`.

Every part runs as its own process, as deployed: an OpenAI-compatible model server (the
project's simulator, about 50 ms an answer, slots enough never to queue), one `llmq serve`,
one gateway and one `llmq worker --backend openai` in front of it. An aiohttp load generator in
this process sends chat requests open-loop on a schedule, through the front door and, in the same
run, straight to the model server (the baseline); a request's latency runs from its scheduled
send to the last byte of its answer, and every request sent counts.

- ``cpu_per_request``: at each rate, the CPU time (psutil: user + system) each process spent
  over the measured rounds through the front door, per request answered; the model server's own
  is the reference. Added latency = front door − direct, medians over rounds.
- ``load_curve``: the same path at rising rates until the added p99 passes ``KNEE_MS``; each
  point, and the knee (the highest rate within it).
- Streamed (``"stream": true``): the added time to the first token (first content chunk).

    python bench/cost_bench.py --rates 100 500 [--seconds 10] [--rounds 3] [--stream]
    python bench/run.py cpu_per_request load_curve
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gateway_bench as gb  # noqa: E402
import serve_bench as sb  # noqa: E402

from pipeline.config import Settings  # noqa: E402
from pipeline.simulator.process import SimulatorProcess  # noqa: E402

#: The model server: 4 tokens at 12.5 ms each, no prefill cost, 1,024 slots (never queues).
SIM_ARGS = ("--max-num-seqs", "1024", "--ttft-ms", "0", "--ms-per-token", "12.5", "--batch-slowdown", "0",
            "--served-model-name", "sim-small")
MAX_TOKENS = 4
KNEE_MS = 50.0
WARM_UP_S = 3.0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system + t.children_user + t.children_system


async def _round(url: str, key, schedule, *, stream: bool) -> list[tuple[float, float | None]]:
    """Each request at its time; (scheduled s, latency ms or None). Streamed: the latency is the
    time to the first chunk with text."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024),
                                     timeout=aiohttp.ClientTimeout(total=sb.UNANSWERED_MS / 1000)) as session:
        async def send(tenant: int, messages) -> bool:
            body = {"model": "sim-small", "messages": messages, "max_tokens": MAX_TOKENS, "stream": stream}
            headers = {"Authorization": f"Bearer {key(tenant)}"} if key else {}
            async with session.post(f"{url}/chat/completions", headers=headers, json=body) as r:
                if r.status != 200:
                    await r.read()
                    return False
                if not stream:
                    return b'"chat.completion"' in await r.read()
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                        return True  # the first token: the rest of the stream is not timed
                return False

        return await sb._paced(schedule, send)


def _profile(pids: dict[str, int], seconds: float, out_dir: Path, tag: str) -> list:
    """py-spy (PyPI) on each llmq process for ``seconds``, sampling without pausing it and only the
    thread that holds the interpreter lock (its Python CPU; waits in C code would count otherwise); collapsed
    stacks in ``out_dir/<process>-<tag>.txt`` (summarised by bench/profile_summary.py)."""
    import shutil
    import subprocess

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out_dir.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([spy, "record", "--nonblocking", "--gil", "--format", "raw", "--rate", "200",
                              "--duration", str(int(seconds)), "--pid", str(pid),
                              "--output", str(out_dir / f"{name}-{tag}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items() if name in ("gateway", "worker", "serve")]


def _measure(settings: Settings, rates: list[int], *, seconds: float, rounds: int, stream: bool,
             stop_past_ms: float | None = None, profile_dir: Path | None = None) -> dict:
    s = gb.fresh(settings)
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        registry = sb._registry(tmp_path / "tenants.toml")
        sim = SimulatorProcess(*SIM_ARGS)
        gw = worker = serve = None
        try:
            gw = gb.GatewayProcess(s, gb.gateway_config({}) + f'\n[tenants]\nfile = "{registry}"\n', tmp_path)
            worker = gb.WorkerProcess(s, tmp_path, inflight=Settings.load(env={}).worker.max_inflight, env={
                "LLMQ_WORKER__BACKEND": "openai", "LLMQ_WORKER__OPENAI_BASE_URL": sim.base_url})
            serve = sb.ServeProcess(s, tmp_path, registry, reply_partition=0,
                                    linger_ms=Settings.load(env={}).serve.producer_linger_ms)
            pids = {"gateway": gw.proc.pid, "worker": worker.proc.pid, "serve": serve.proc.pid,
                    "model_server": sim.proc.pid, "load_generator": os.getpid()}
            front, direct = f"{serve.url}/v1", sim.base_url
            warm = sb._schedule(rates[0], WARM_UP_S, "warm")
            asyncio.run(_round(front, sb._key, warm, stream=stream))
            asyncio.run(_round(direct, None, warm, stream=stream))
            for rate in rates:
                runs: dict[str, list[dict]] = {"llmq": [], "direct": []}
                cpu = {name: 0.0 for name in pids}
                answered = 0
                for r in range(rounds):
                    for path in ("llmq", "direct") if r % 2 == 0 else ("direct", "llmq"):
                        schedule = sb._schedule(rate, seconds, f"{path}{rate}.{r}")
                        before = {name: _cpu_s(pid) for name, pid in pids.items()} if path == "llmq" else None
                        spies = (_profile(pids, seconds - 1, profile_dir, f"{rate}{'-stream' if stream else ''}")
                                 if profile_dir is not None and path == "llmq" and r == 0 else [])
                        gc.collect()
                        gc.disable()
                        try:
                            samples = asyncio.run(_round(front if path == "llmq" else direct,
                                                         sb._key if path == "llmq" else None, schedule, stream=stream))
                        finally:
                            gc.enable()
                        for spy in spies:
                            spy.wait(30)
                        if before is not None:
                            for name, pid in pids.items():
                                cpu[name] += _cpu_s(pid) - before[name]
                            answered += sum(1 for _, lat in samples if lat is not None)
                        runs[path].append(sb._stats(samples))
                        _log(f"  {'stream ' if stream else ''}{rate}/s round {r} {path}: {runs[path][-1]}")
                # A round whose direct baseline lost requests says nothing of llmq (the model
                # server itself failed): it is left out of both medians and counted.
                bad = {r for r, x in enumerate(runs["direct"]) if x["unanswered"]}
                kept = {path: [x for r, x in enumerate(rs) if r not in bad] for path, rs in runs.items()}
                if not kept["llmq"]:
                    _log(f"  {rate}/s: the model server failed the baseline in every round; no figure")
                    points.append({"rate_per_s": rate, "baseline_failed_rounds": len(bad), "rounds": rounds})
                    continue
                med = {path: {k: statistics.median(x[k] for x in rs) for k in ("p50_ms", "p99_ms")}
                       for path, rs in kept.items()}
                point = {"rate_per_s": rate,
                         "added_p50_ms": round(med["llmq"]["p50_ms"] - med["direct"]["p50_ms"], 2),
                         "added_p99_ms": round(med["llmq"]["p99_ms"] - med["direct"]["p99_ms"], 2),
                         "llmq": med["llmq"], "direct": med["direct"],
                         "unanswered": sum(x["unanswered"] for x in kept["llmq"]),
                         "baseline_failed_rounds": len(bad),
                         "sent": int(rate * seconds) * rounds,
                         "cpu_ms_per_request": {name: round(cpu[name] * 1000 / max(answered, 1), 3) for name in pids}}
                point["cpu_ms_per_request"]["llmq_total"] = round(sum(
                    point["cpu_ms_per_request"][n] for n in ("gateway", "worker", "serve")), 3)
                _log(f"  {rate}/s: added p50 {point['added_p50_ms']} p99 {point['added_p99_ms']} ms; "
                     f"CPU ms/request {point['cpu_ms_per_request']}")
                points.append(point)
                if stop_past_ms is not None and point["added_p99_ms"] > stop_past_ms:
                    break
        finally:
            for proc in (serve, worker, gw):
                if proc is not None:
                    proc.stop()
            if sim.output:
                _log(f"  the model server printed {len(sim.output)} lines; the last: {sim.output[-1].strip()[:300]}")
            sim.stop()
            gb.drop_topics(s)
    return {"points": points, "seconds_per_round": seconds, "rounds": rounds, "stream": stream, "overrides": {},
            "conditions": "simulator (4 tokens x 12.5 ms, 1,024 slots), llmq serve, gateway and llmq worker "
                          "(backend openai, shipped defaults) as processes; 50 tenants; the load generator and "
                          "the direct baseline in this process, latency from the scheduled send"}


def cpu_per_request(settings: Settings, args) -> dict:
    rounds = max(1, min(getattr(args, "rounds", 3), 3))
    out = _measure(settings, [100, 500], seconds=10.0, rounds=rounds, stream=False)
    out["streamed"] = _measure(settings, [100], seconds=10.0, rounds=rounds, stream=True)
    return out


def load_curve(settings: Settings, args) -> dict:
    rounds = max(1, min(getattr(args, "rounds", 3), 3))
    out = _measure(settings, [100, 200, 300, 400, 500, 700, 1000], seconds=6.0, rounds=rounds, stream=False,
                   stop_past_ms=KNEE_MS)
    within = [p["rate_per_s"] for p in out["points"] if p.get("added_p99_ms", float("inf")) <= KNEE_MS]
    out.update(knee_ms=KNEE_MS, knee_rate_per_s=max(within) if within else None)
    return out


def idle_gateway_cpu(settings: Settings, seconds: float = 30.0) -> float:
    """Percent of a core one gateway uses on its own settings (and the environment's LLMQ_GATEWAY__*
    overrides) with nothing to read: what its fetch wait costs while traffic sleeps."""
    s = gb.fresh(settings)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gw = gb.GatewayProcess(s, gb.gateway_config({}), Path(tmp))
            try:
                time.sleep(15)  # start-up and the first rebalance settle
                before = _cpu_s(gw.proc.pid)
                time.sleep(seconds)
                return round(100 * (_cpu_s(gw.proc.pid) - before) / seconds, 1)
            finally:
                gw.stop()
    finally:
        gb.drop_topics(s)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--idle", action="store_true", help="only: an idle gateway's CPU, percent of a core")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="py-spy each llmq process during the first round at each rate (its CPU then counts too)")
    args = parser.parse_args(argv)
    with gb.standalone_settings("llmq-cost-bench-") as settings:
        if args.idle:
            print(json.dumps({"idle_gateway_cpu_pct": idle_gateway_cpu(settings)}))
            return 0
        result = _measure(settings, args.rates, seconds=args.seconds, rounds=args.rounds, stream=args.stream,
                          profile_dir=args.profile)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
