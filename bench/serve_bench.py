"""`serve_overhead`: what `llmq serve` adds to a request's way, against the same requests through the SDK.

One gateway and one `llmq worker` (simulated model, 0 ms) as processes, one `llmq serve` process
(reply partition 0). Rounds alternate between

* **http**: an aiohttp load generator in this process POSTs ``/v1/chat/completions`` at a fixed
  rate on a schedule, over a pool of keep-alive connections; a request's latency runs from the
  moment the schedule sent it to the moment its whole answer was read;
* **sdk**: the same requests (same tenants, messages, max_tokens) through
  :class:`pipeline.client.AsyncLlmqClient` in this process (reply partition 1, the producer
  linger serve uses), ``submit_and_wait`` on the same schedule.

``added_p50_ms``/``added_p99_ms`` are the medians over rounds of http minus sdk; every request
sent counts (one never answered at the wait); both paths run WARM_UP_S at the full rate before
the first round, and the first second of each round is left out.

    python bench/serve_bench.py [--seconds 5] [--rounds 1] [--rate 500]   # prints the result
    python bench/run.py serve_overhead                                    # as part of `make bench`
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gateway_bench as gb  # noqa: E402
from machine import cpu_times, machine_load  # noqa: E402

from pipeline.broker import free_port  # noqa: E402
from pipeline.config import Settings  # noqa: E402
from pipeline.models import Request  # noqa: E402
from pipeline.tenants.keys import hash_key  # noqa: E402

RATE = 500
TENANTS = 50
UNANSWERED_MS = 60_000
TARGET_ADDED_P99_MS = 10.0
WARM_UP_S = 3.0


def _key(i: int) -> str:
    return f"bench-key-{i:04d}-0123456789abcdef"


def _registry(path: Path) -> Path:
    lines = []
    for i in range(TENANTS):
        lines += [f"[t{i}]", 'tier = "standard"', f'key_hashes = ["{hash_key(_key(i))}"]', ""]
    path.write_text("\n".join(lines))
    return path


class ServeProcess:
    def __init__(self, settings: Settings, tmp: Path, registry: Path, reply_partition: int, linger_ms: int):
        self.port = free_port()
        cfg = tmp / f"serve-{uuid.uuid4().hex[:6]}.toml"
        cfg.write_text(f'[tenants]\nfile = "{registry}"\n\n[serve]\nproducer_linger_ms = {linger_ms}\n')
        self.log = tmp / f"{cfg.stem}.log"
        env = {**os.environ, "LLMQ_CONFIG": str(cfg), **settings.topology_env()}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--port", str(self.port),
                                          "--reply-partitions", str(reply_partition)], env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp)
        self.url = f"http://127.0.0.1:{self.port}"
        import urllib.request

        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        gb._terminate(self.proc)


def _schedule(rate: int, seconds: float, tag: str):
    """(send at, tenant index, messages): the same for both paths but for the text."""
    n = int(rate * seconds)
    return [(i / rate, i % TENANTS, [{"role": "user", "content": f"{tag} {i} tell me about queues"}])
            for i in range(n)]


async def _paced(schedule, send) -> list[tuple[float, float | None]]:
    """Run ``send(tenant, messages)`` for each entry at its time; (scheduled, latency ms or None)."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.2
    out: list[tuple[float, float | None]] = []
    tasks = []

    async def one(at: float, tenant: int, messages) -> None:
        try:
            ok = await send(tenant, messages)
        except Exception:  # noqa: BLE001 (counted as unanswered)
            ok = False
        out.append((at, (loop.time() - (start + at)) * 1000 if ok else None))

    for at, tenant, messages in schedule:
        delay = start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(at, tenant, messages)))
    await asyncio.gather(*tasks)
    return out


async def _http_round(url: str, schedule) -> list:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512),
                                     timeout=aiohttp.ClientTimeout(total=UNANSWERED_MS / 1000)) as session:
        async def send(tenant: int, messages) -> bool:
            async with session.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {_key(tenant)}"},
                                    json={"model": "sim-small", "messages": messages, "max_tokens": 4}) as r:
                body = await r.read()
                return r.status == 200 and b'"chat.completion"' in body

        return await _paced(schedule, send)


async def _sdk_round(client, schedule) -> list:
    async def send(tenant: int, messages) -> bool:
        req = Request.new(f"t{tenant}", messages=messages, max_tokens=4, timeout_ms=UNANSWERED_MS)
        resp = await client.submit_and_wait(req, timeout=UNANSWERED_MS / 1000)
        return resp.status.value == "COMPLETED"

    return await _paced(schedule, send)


def _stats(samples: list, skip_s: float = 1.0) -> dict:
    kept = [lat for at, lat in samples if at >= skip_s]
    lat = sorted(UNANSWERED_MS if x is None else x for x in kept)
    return {"p50_ms": round(lat[len(lat) // 2], 2), "p99_ms": round(gb.p99(lat), 2), "samples": len(lat),
            "unanswered": sum(x is None for x in kept)}


def serve_overhead(settings: Settings, args, *, rate: int = RATE, seconds: float | None = None,
                   rounds: int | None = None) -> dict:
    rounds = rounds or max(1, min(getattr(args, "rounds", 3), 3))
    if seconds is None:
        seconds = max(3.0, min(10.0, getattr(args, "messages", 100_000) / (rate * 2 * rounds)))
    linger_ms = Settings.load(env={}).serve.producer_linger_ms
    s = gb.fresh(settings)
    results: dict[str, list[dict]] = {"http": [], "sdk": []}
    machine: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        registry = _registry(tmp_path / "tenants.toml")
        gw = gb.GatewayProcess(s, gb.gateway_config({}) + f'\n[tenants]\nfile = "{registry}"\n', tmp_path)
        worker = gb.WorkerProcess(s, tmp_path, inflight=64)
        serve = None
        try:
            serve = ServeProcess(s, tmp_path, registry, reply_partition=0, linger_ms=linger_ms)
            from pipeline.client import AsyncLlmqClient

            async def run_all() -> None:
                client = AsyncLlmqClient(s, reply_partitions=[1], producer_config={"linger.ms": linger_ms})
                try:
                    # The first seconds after the processes start are not the steady state (the
                    # first round measured was seconds slower whichever path it was): both paths
                    # at the full rate first, unmeasured.
                    warm = _schedule(rate, WARM_UP_S, "warm")
                    await _http_round(serve.url, warm)
                    await _sdk_round(client, warm)
                    for r in range(rounds):
                        for path in ("http", "sdk") if r % 2 == 0 else ("sdk", "http"):
                            schedule = _schedule(rate, seconds, f"{path}{r}")
                            gc.collect()
                            gc.disable()
                            before = cpu_times()
                            try:
                                samples = await (_http_round(serve.url, schedule) if path == "http"
                                                 else _sdk_round(client, schedule))
                            finally:
                                gc.enable()
                            machine.append({"path": path, **machine_load(before, cpu_times())})
                            results[path].append(_stats(samples))
                            gb._log(f"  serve_overhead round {r} {path}: {results[path][-1]}")
                finally:
                    await client.close()

            asyncio.run(run_all())
        finally:
            if serve is not None:
                serve.stop()
            worker.stop()
            gw.stop()
            gb.drop_topics(s)
    med = {path: {k: statistics.median(r[k] for r in rs) for k in ("p50_ms", "p99_ms")}
           for path, rs in results.items()}
    added_p99 = round(med["http"]["p99_ms"] - med["sdk"]["p99_ms"], 2)
    return {"rate_per_s": rate, "seconds_per_round": seconds, "rounds": rounds,
            "added_p50_ms": round(med["http"]["p50_ms"] - med["sdk"]["p50_ms"], 2), "added_p99_ms": added_p99,
            "target_added_p99_ms": TARGET_ADDED_P99_MS, "within_target": added_p99 <= TARGET_ADDED_P99_MS,
            "http": {**med["http"], "samples": sum(r["samples"] for r in results["http"]),
                     "unanswered": sum(r["unanswered"] for r in results["http"]), "rounds": results["http"]},
            "sdk": {**med["sdk"], "samples": sum(r["samples"] for r in results["sdk"]),
                    "unanswered": sum(r["unanswered"] for r in results["sdk"]), "rounds": results["sdk"]},
            "machine_per_round": machine,
            "conditions": "one gateway, one llmq worker (64 in flight, simulated model at 0 ms) and one llmq serve "
                          "as processes; 50 tenants; chat requests with max_tokens 4; the load generator (aiohttp, "
                          "512 keep-alive connections) and the SDK baseline share this process; latency from the "
                          "scheduled send; its garbage collector off while it measures"}


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rate", type=int, default=RATE)
    args = parser.parse_args(argv)
    with gb.standalone_settings("llmq-serve-bench-") as settings:
        result = serve_overhead(settings, args, rate=args.rate, seconds=args.seconds, rounds=args.rounds)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
