"""docs/capacity.md from bench/results.json: how many partitions, gateways, workers and how much
broker and state a load needs, derived from what ``make bench`` measured on one instance.

Every figure in the document is either a results.json field (named beside it) or arithmetic on
those fields shown in the text; nothing is a guess. ``make bench`` runs this after the scenarios;
``python bench/capacity.py`` redraws it from the last results.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results.json"
OUT = ROOT / "docs" / "capacity.md"

RATES = (1_000, 10_000, 100_000)
TENANTS = (1_000, 100_000, 1_000_000)
#: Run each instance at half of what it measured alone: headroom for a failover (a survivor takes a
#: dead peer's partitions) and for bursts. A planning choice, stated, not a measurement.
HEADROOM = 0.5
#: Standby replicas of the gateway's tables (pipeline/gateway/app.py, table_standby_replicas).
STANDBYS = 1


def field(results: dict, path: str):
    node = results["scenarios"]
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def plan(results: dict) -> str:
    f = lambda p: field(results, p)  # noqa: E731
    gw_rate = f("gateway_throughput.gateway_msgs_per_s")
    raw_rate = f("gateway_throughput.raw_msgs_per_s")
    rec_adm = f("gateway_throughput.broker_records_per_admitted")
    bytes_adm = f("gateway_throughput.broker_bytes_per_admitted")
    kb_tenant = f("gateway_memory.kb_per_tenant")
    rec_ans = f("backend_utilization.llmq.broker_records_per_answer")
    bytes_ans = f("backend_utilization.llmq.broker_bytes_per_answer")
    cpu_req = f("backend_utilization.llmq.worker_cpu_ms_per_request")
    cpu_stream = f("streaming_ttft.worker_cpu_ms_per_stream")
    busy = f("backend_utilization.slot_busy_fraction")
    takeover = f("gateway_failover.median_s")
    missing = [name for name, v in (("gateway_throughput.gateway_msgs_per_s", gw_rate),
                                    ("gateway_throughput.broker_records_per_admitted", rec_adm),
                                    ("gateway_memory.kb_per_tenant", kb_tenant),
                                    ("backend_utilization.llmq.worker_cpu_ms_per_request", cpu_req)) if v is None]
    date = results.get("conditions", {}).get("date", "?")
    lines = [
        "# Capacity plan",
        "",
        "What one machine's llmq outgrows first, and how many of each part a load needs. Written by",
        "`bench/capacity.py` from `bench/results.json` (the last `make bench`, " + date + ", "
        f"{results.get('conditions', {}).get('cpus', '?')} cores shared by the broker, the gateway, the worker and",
        "the load): each per-instance figure below names its field; the tables are arithmetic on them.",
        "Measured on a small, noisy machine, they are a floor: a dedicated core does more.",
        "",
    ]
    if missing:
        lines += ["**Not derivable yet**: `make bench` has not written " + ", ".join(f"`{m}`" for m in missing) + ".", ""]
        return "\n".join(lines) + "\n"
    per_core_worker = 1000.0 / cpu_req  # requests a worker process's core handles, its own CPU only
    lines += [
        "## Per-instance figures (measured)",
        "",
        "| figure | value | results.json field |",
        "|---|---:|---|",
        f"| admissions per second, one gateway process | {gw_rate:,.0f} | `gateway_throughput.gateway_msgs_per_s` |",
        f"| a Faust agent that only forwards (the ceiling of a Faust gateway) | "
        f"{f('gateway_throughput.faust_passthrough_msgs_per_s'):,.0f} msg/s | "
        "`gateway_throughput.faust_passthrough_msgs_per_s` |",
        f"| raw produce→consume through the same broker | {raw_rate:,.0f} msg/s | `gateway_throughput.raw_msgs_per_s` |",
        f"| records the gateway writes per admitted request | {rec_adm} | `gateway_throughput.broker_records_per_admitted` |",
        f"| bytes (key + value) it writes per admitted request | {bytes_adm:,.0f} | `gateway_throughput.broker_bytes_per_admitted` |",
        f"| records a worker writes per answer (response, receipt, chunks) | {rec_ans} | `backend_utilization.llmq.broker_records_per_answer` |",
        f"| bytes a worker writes per answer | {bytes_ans:,.0f} | `backend_utilization.llmq.broker_bytes_per_answer` |",
        f"| gateway memory per tenant | {kb_tenant} KB | `gateway_memory.kb_per_tenant` |",
        f"| worker CPU per request (32–96-token answers, OpenAI backend) | {cpu_req} ms | `backend_utilization.llmq.worker_cpu_ms_per_request` |",
        f"| worker CPU per streamed request (16 tokens) | {cpu_stream} ms | `streaming_ttft.worker_cpu_ms_per_stream` |",
        f"| model-server slots kept busy under a backlog | {busy} | `backend_utilization.slot_busy_fraction` |",
    ]
    if takeover is not None:
        lines.append(f"| gateway takeover after a SIGKILL (median) | {takeover} s | `gateway_failover.median_s` |")
    front = (results["scenarios"].get("cpu_per_request") or {}).get("points") or []
    if front:
        at = front[0]
        cpu = at["cpu_ms_per_request"]
        lines.append(f"| CPU a request through the front door at {at['rate_per_s']} req/s: serve + gateway + worker "
                     f"(the model server's own) | {cpu['serve']} + {cpu['gateway']} + {cpu['worker']} = "
                     f"{cpu['llmq_total']} ms ({cpu['model_server']} ms) | `cpu_per_request.points[0].cpu_ms_per_request` |")
        lines.append(f"| latency llmq adds there, p50 / p99 | +{at['added_p50_ms']} / +{at['added_p99_ms']} ms "
                     "| `cpu_per_request.points[0].added_p50_ms`, `added_p99_ms` |")
    lines += [
        "",
        f"Planning rule: every instance runs at {HEADROOM:.0%} of what it did alone, so that a survivor can take a",
        "dead peer's partitions and a burst has room. The request itself (one record, written by the client) is",
        "not counted in the gateway's writes.",
        "",
        "## Requests per second",
        "",
        "| load | gateways | partitions per band | worker processes (CPU) | broker writes | broker write bandwidth |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for rate in RATES:
        gateways = max(2, math.ceil(rate / (gw_rate * HEADROOM)))  # two at least: one may fail
        workers = max(2, math.ceil(rate / (per_core_worker * HEADROOM)))
        partitions = 2 ** math.ceil(math.log2(max(gateways, workers, 6)))
        records = rate * (1 + rec_adm + rec_ans)
        mb = rate * (bytes_adm + bytes_ans) / 1e6
        rows.append((rate, gateways, partitions, workers, records, mb))
        lines.append(f"| {rate:,}/s | {gateways} | {partitions} | {workers} | {records:,.0f} records/s | {mb:,.1f} MB/s |")
    lines += [
        "",
        "- **gateways** = load / (admissions per gateway x headroom), two at least. **Partitions per band** at",
        "  least the larger of gateways and workers (a partition is read by one member of a group), rounded up to",
        "  a power of two; every request topic needs the same count (the gateway's tables are co-partitioned",
        "  with them), and so do the dispatch topics of one pool.",
        "- **worker processes** = load / (requests a worker's core handles x headroom): llmq's own CPU. The",
        "  model servers are sized apart: in flight = load x seconds per call (Little's law); a server with",
        "  *s* slots serves *s* of them, and llmq keeps them busy (the slot figure above) without queueing in them.",
        "- **broker writes** = load x (1 request + the gateway's + a worker's records per request).",
        "",
        "## Tenants",
        "",
        "| tenants | gateway state, all instances (with standbys) | per gateway at 10k/s |",
        "|---:|---:|---:|",
    ]
    gateways_10k = rows[1][1]
    for tenants in TENANTS:
        total_mb = tenants * kb_tenant * (1 + STANDBYS) / 1024
        lines.append(f"| {tenants:,} | {total_mb:,.0f} MB | {total_mb / gateways_10k:,.0f} MB |")
    lines += [
        "",
        f"State = tenants x memory per tenant x (1 + {STANDBYS} standby). It lives in the gateway's tables, whose",
        "changelog topics are compacted: a restarted gateway reads its partitions' share back (recovery time grows",
        "with it), and the changelog traffic is part of the gateway's writes above.",
        "",
        "## What gives first",
        "",
    ]
    first_1k = ("the model servers: 1k requests/s of multi-second calls is thousands in flight, far more slots than "
                "a gateway or worker process needs cores")
    b_records = rows[2][4]
    e2e_p99 = f("end_to_end_latency.p99_ms")
    lines += [
        f"- **1k/s**: {first_1k}. One gateway admits {gw_rate:,.0f}/s from a backlog, but paced at 1k/s over",
        f"  the default 6 partitions per band its fetches fall into Faust's 1.5-s fetch wait (end-to-end p99 {e2e_p99:,} ms,",
        "  `end_to_end_latency.p99_ms`; docs/gateway.md, \"How much one gateway takes\"): run two, which failover",
        "  needs anyway.",
        f"- **10k/s**: the gateway's single event loop: {rows[1][1]} instances at the headroom above, so the request",
        "  topics need at least that many partitions per band before the load arrives (partitions cannot be",
        "  re-keyed later without moving tenants between gateways).",
        f"- **100k/s**: the broker: {b_records:,.0f} records/s, against {raw_rate:,.0f}/s measured for a raw",
        "  passthrough on this machine's broker. That is a cluster of brokers sized for the write bandwidth",
        "  above (times the replication factor), with the partitions spread over them.",
        "- **1M tenants**: the gateways' memory and their recovery after a restart, not the CPU; more gateway",
        "  instances spread it (each holds its partitions' tenants and a standby copy of a peer's).",
        "",
        "Redraw after `make bench`: `python bench/capacity.py`.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    results = json.loads(RESULTS.read_text())
    OUT.write_text(plan(results))
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
