"""Routing by cache with two real llama.cpp servers (llama-cpp-python on the tiny random model).

llama-cpp-python keeps the KV state of its last prompt and evaluates only what follows the
longest prefix it shares with the next one (it logs "N prefix-match hit, remaining M prompt
tokens to eval" when verbose); its answers report no cached tokens. So: a conversation's
second turn goes to the server of its first, and that server evaluates far fewer prompt tokens
for it than the prompt has.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from pipeline.models import Request
from pipeline.observability.metrics import RoutingSeries
from pipeline.worker.backends.cache_routing import server_label
from pipeline.worker.backends.openai_http import OpenAIBackend
from pipeline.worker.backends.routing import RoutingTable
from tests.llama.server import MODEL_ALIAS, LlamaServer

pytestmark = pytest.mark.llama
_EVAL = re.compile(r"(\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")


class VerboseLlamaServer(LlamaServer):
    """Logs its prompt evaluation (what this test reads)."""

    def command(self) -> list[str]:
        argv = super().command()
        argv[argv.index("--verbose") + 1] = "True"
        return argv


def _turn(turn: int) -> Request:
    messages = [{"role": "system", "content": "You are a patient tutor who explains every step. " * 6},
                {"role": "user", "content": "Explain how a hash table resolves collisions, slowly. " * 4}]
    if turn > 1:
        messages += [{"role": "assistant", "content": "First, a hash function maps keys to buckets."},
                     {"role": "user", "content": "And then?"}]
    return Request.new("t", None, messages=messages, model=MODEL_ALIAS, max_tokens=4, timeout_ms=60_000)


def test_a_conversations_second_turn_goes_to_its_server_and_evaluates_only_what_is_new(llama_model, tmp_path):
    servers = [VerboseLlamaServer(llama_model, tmp_path / f"server{i}.log") for i in range(2)]
    for s in servers:
        s.start()
    metrics = RoutingSeries()
    try:
        async def go():
            backend = OpenAIBackend(routes=RoutingTable({"*": [s.base_url for s in servers]}),
                                    routing_metrics=metrics, params={"temperature": 0.0, "seed": 1})
            try:
                await backend.complete(_turn(1))
                first = _routed(metrics)
                await backend.complete(_turn(2))
                return first
            finally:
                await backend.close()

        first = asyncio.run(go())
        routed = _routed(metrics)
    finally:
        for s in servers:
            s.stop()
    (home,) = first
    assert routed == {home: 2}, routed  # both turns on the server of the first
    served = next(s for s in servers if server_label_of(s) == home)
    evals = [(int(hit), int(left)) for hit, left in _EVAL.findall(served.log_text())]
    other = next(s for s in servers if s is not served)
    assert not _EVAL.findall(other.log_text()) or all(int(h) == 0 for h, _ in _EVAL.findall(other.log_text()))
    # The second turn's prompt shares the first's: most of it was not evaluated again.
    hit, left = evals[-1]
    assert hit > 3 * left, served.log_tail()


def _routed(metrics: RoutingSeries) -> dict[str, float]:
    out: dict[str, float] = {}
    for (server, _reason), child in metrics.routes.children.items():
        out[server] = out.get(server, 0.0) + child.value
    return out


def server_label_of(server: LlamaServer) -> str:
    from pipeline.worker.backends.routing import Server

    return server_label(Server(server.base_url))
