"""``python -m pipeline.simulator``: run the vLLM-like simulator until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from pipeline.simulator.engine import EngineConfig
from pipeline.simulator.server import SimulatorConfig, SimulatorServer

DESCRIPTION = """\
An OpenAI-compatible model server that behaves like vLLM under load, without a model.

It serves POST /v1/chat/completions and /v1/completions (streamed or not), GET /v1/models,
GET /health and GET /metrics (vllm:num_requests_running, vllm:num_requests_waiting,
vllm:kv_cache_usage_perc, vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total,
vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds, ...).

Scheduling, as vLLM's: at most --max-num-seqs requests run at once, the rest wait in one
first-come-first-served queue; a waiting request joins the running batch at the next
engine step once a slot and KV cache for it are free. Each step every running request
emits one token. A step with B running requests, of which the joiners J are prefilled in it, lasts

    ms_per_token * (1 + batch_slowdown * (B - 1))  +  sum over J of (ttft_ms + prefill_ms_per_token * prompt_tokens)

so time per token and time to first token both grow with the batch. Prefix caching, as
vLLM's: prompts are cut into 16-token blocks with chained hashes; a joiner's prefill skips
the blocks at its prompt's start still cached (prompt_tokens above counts only the others;
usage.prompt_tokens_details.cached_tokens says how many were cached); finished requests'
blocks stay cached until the KV cache needs their room, least recently used first. Answers are
deterministic words chosen from the model name, the prompt and the token's position.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = EngineConfig()
    p = argparse.ArgumentParser(prog="python -m pipeline.simulator", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--served-model-name", nargs="+", default=["sim-small"], metavar="NAME",
                   help="model names it answers to; others get 404 (default sim-small)")
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                   help=f"requests running at once, the batch's slots (default {defaults.max_num_seqs})")
    p.add_argument("--ttft-ms", type=float, default=defaults.ttft_ms,
                   help=f"fixed prefill cost of a request in the step it joins (default {defaults.ttft_ms:g})")
    p.add_argument("--prefill-ms-per-token", type=float, default=defaults.prefill_ms_per_token,
                   help="prefill cost per prompt token (default 0)")
    p.add_argument("--ms-per-token", type=float, default=defaults.ms_per_token,
                   help=f"duration of a decode step with one running request (default {defaults.ms_per_token:g})")
    p.add_argument("--batch-slowdown", type=float, default=defaults.batch_slowdown,
                   help="extra step time per further running request, as a fraction of --ms-per-token "
                        f"(default {defaults.batch_slowdown:g})")
    p.add_argument("--max-model-len", type=int, default=defaults.max_model_len,
                   help=f"prompt + max_tokens limit of one request (default {defaults.max_model_len})")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV cache size in tokens; a request reserves prompt + max_tokens when it joins "
                        "(default max-num-seqs x max-model-len, so only slots limit the batch)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="prefill every prompt in full (vLLM's --no-enable-prefix-caching)")
    p.add_argument("--kv-usage-counts-cached", action="store_true",
                   help="report cached blocks no request holds as used in vllm:kv_cache_usage_perc (vLLM "
                        "counts them as free), so a full cache reads full while nothing runs: for tests")
    p.add_argument("--output-tokens", type=int, default=None,
                   help="natural answer length: answers end with finish_reason stop after this many tokens "
                        "(default: every answer runs to max_tokens, finish_reason length)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> SimulatorConfig:
    kv = args.kv_cache_tokens or args.max_num_seqs * args.max_model_len
    engine = EngineConfig(max_num_seqs=args.max_num_seqs, ttft_ms=args.ttft_ms, ms_per_token=args.ms_per_token,
                          batch_slowdown=args.batch_slowdown, prefill_ms_per_token=args.prefill_ms_per_token,
                          kv_cache_tokens=kv, max_model_len=args.max_model_len,
                          prefix_caching=not args.no_prefix_caching,
                          kv_usage_counts_cached=args.kv_usage_counts_cached)
    return SimulatorConfig(engine=engine, served_model_names=tuple(args.served_model_name),
                           output_tokens=args.output_tokens)


async def serve(config: SimulatorConfig, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with SimulatorServer(config, host, port) as server:
        print(f"simulator serving {', '.join(config.served_model_names)} on {server.base_url} "
              f"(max_num_seqs {config.engine.max_num_seqs})", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
