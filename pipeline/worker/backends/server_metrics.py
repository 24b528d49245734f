"""Reading a model server's load from its Prometheus ``/metrics``, for pacing.

Series understood (summed over their label sets, e.g. several served models): vLLM's
``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` on older releases);
and its prefix cache's counters ``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total`` (tokens found cached, tokens looked up) for routing by cache;
llama.cpp's server with ``--metrics``: ``llamacpp:requests_processing`` and
``llamacpp:requests_deferred``; TGI: ``tgi_batch_current_size`` and ``tgi_queue_size``.
A server without them (or without ``/metrics``) is paced by time to first token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import aiohttp

from pipeline.worker.backends.pacing import ServerLoad

log = logging.getLogger(__name__)

_RUNNING = ("vllm:num_requests_running", "llamacpp:requests_processing", "tgi_batch_current_size")
_WAITING = ("vllm:num_requests_waiting", "llamacpp:requests_deferred", "tgi_queue_size")
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_PREFIX_HITS = "vllm:prefix_cache_hits_total"
_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
_WANTED = frozenset(_RUNNING + _WAITING + _KV + (_PREFIX_HITS, _PREFIX_QUERIES))
#: Without the series, look again this much later (a server may be restarted with them).
REDISCOVER_S = 30.0


def parse_load(text: str, at: float) -> ServerLoad | None:
    """The load in a Prometheus text exposition, or None when it has no running/waiting pair."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if brace != -1 and (space == -1 or brace < space) else space
        if end <= 0:
            continue
        name = line[:end]
        if name not in _WANTED:
            continue
        rest = line[line.rfind("}") + 1:] if brace == end else line[end:]
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        values[name] = values.get(name, 0.0) + value
    running = next((values[n] for n in _RUNNING if n in values), None)
    waiting = next((values[n] for n in _WAITING if n in values), None)
    if running is None or waiting is None:
        return None
    kv = next((values[n] for n in _KV if n in values), None)
    return ServerLoad(running, waiting, kv, at, values.get(_PREFIX_HITS), values.get(_PREFIX_QUERIES))


class MetricsPoller:
    """Reads one server's ``/metrics`` every ``interval_s`` and hands each load to ``on_load``.

    ``on_load(None)`` means the server has no usable metrics (the pacer then uses TTFT);
    a failed read hands nothing, so the last sample goes stale and is not trusted.
    """

    def __init__(self, client: aiohttp.ClientSession, url: str, on_load: Callable[[ServerLoad | None], None], *,
                 interval_s: float = 0.05, clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.url = url
        self.on_load = on_load
        self.interval_s = interval_s
        self.clock = clock
        self.supported: bool | None = None  # unknown until the first answer
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"metrics {self.url}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def poll_once(self) -> ServerLoad | None:
        sent = self.clock()  # the sample is at least this old: the conservative side
        async with self.client.get(self.url, timeout=aiohttp.ClientTimeout(total=max(0.5, self.interval_s * 4))) as resp:
            if resp.status != 200:
                self.supported = False
                self.on_load(None)
                return None
            text = await resp.text(errors="replace")
        load = parse_load(text, sent)
        self.supported = load is not None
        self.on_load(load)
        return load

    async def _run(self) -> None:
        while True:
            delay = self.interval_s
            try:
                await self.poll_once()
                if not self.supported:
                    delay = REDISCOVER_S
            except (aiohttp.ClientError, TimeoutError) as exc:
                # The server is unreachable or slow: the sample goes stale on its own.
                log.debug("metrics of %s unreadable: %s", self.url, type(exc).__name__)
                delay = max(self.interval_s, 1.0)
            await asyncio.sleep(delay)
