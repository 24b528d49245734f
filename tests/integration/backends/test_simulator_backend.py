"""The OpenAI backend against the vLLM-like simulator over real HTTP: wire format, pacing, routing."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pipeline.errors import BackendError
from pipeline.models import Request
from pipeline.simulator import EngineConfig, SimulatorConfig, SimulatorServer, answer_text
from pipeline.worker.backends.openai_http import OpenAIBackend
from pipeline.worker.backends.pacing import PacingConfig
from pipeline.worker.backends.routing import RoutingTable


def _sim(slots: int = 4, names=("sim-small",), ttft_ms: float = 5, ms_per_token: float = 2) -> SimulatorServer:
    engine = EngineConfig(max_num_seqs=slots, ttft_ms=ttft_ms, ms_per_token=ms_per_token, max_model_len=512,
                          kv_cache_tokens=slots * 512)
    return SimulatorServer(SimulatorConfig(engine=engine, served_model_names=tuple(names)))


def test_the_simulator_speaks_openai_over_http():
    async def go():
        async with _sim(names=("big", "alias")) as sim:
            async with httpx.AsyncClient(base_url=sim.base_url) as http:
                models = (await http.get("/models")).json()
                text = (await http.post("/completions", json={"model": "alias", "prompt": "hi",
                                                              "max_tokens": 3})).json()
                missing = await http.post("/chat/completions", json={"model": "nope", "messages": []})
                too_long = await http.post("/chat/completions", json={
                    "model": "big", "messages": [{"role": "user", "content": "x"}], "max_tokens": 600})
                async with http.stream("POST", "/chat/completions", json={
                        "model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                        "stream": True, "stream_options": {"include_usage": True}}) as resp:
                    lines = [line async for line in resp.aiter_lines() if line]
                metrics = (await http.get(sim.base_url.removesuffix("/v1") + "/metrics")).text
            return models, text, missing, too_long, lines, metrics

    models, text, missing, too_long, lines, metrics = asyncio.run(go())
    assert [m["id"] for m in models["data"]] == ["big", "alias"]
    assert text["choices"][0]["text"] == answer_text("alias", "hi", 3) and text["usage"]["completion_tokens"] == 3
    assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]
    assert too_long.status_code == 400 and "maximum context length is 512" in too_long.json()["error"]["message"]
    assert lines[-1] == "data: [DONE]" and '"usage":{"prompt_tokens"' in lines[-2]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count"):
        assert name in metrics
    assert 'vllm:request_success_total{model_name="big"} 2.0' in metrics


def test_the_backend_streams_and_completes_from_the_simulator_with_its_usage():
    async def go():
        async with _sim() as sim:
            backend = OpenAIBackend(sim.base_url)
            try:
                req = Request.new("t", "hello", model="sim-small", max_tokens=6)
                whole = await backend.complete(req)
                chunks = [c async for c in backend.stream(req)]
            finally:
                await backend.close()
        return req, whole, chunks

    req, whole, chunks = asyncio.run(go())
    assert whole.output == "".join(c.text for c in chunks) == answer_text("sim-small", "user: hello\n", 6)
    assert not whole.usage_estimated and whole.completion_tokens == 6 and whole.finish_reason == "length"
    assert [c.index for c in chunks] == list(range(7)) and not chunks[-1].usage.estimated


def _burst(paced: bool):
    async def go():
        # 5 ms a token: the burst lasts about a second, several of pacing's 50-ms metric readings,
        # so it learns the 4 slots whatever else the machine runs (at 2 ms it sometimes ended first).
        async with _sim(slots=4, ms_per_token=5) as sim:
            pacing = PacingConfig(initial_limit=2) if paced else None
            backend = OpenAIBackend(sim.base_url, pacing=pacing, max_connections=64)
            try:
                reqs = [Request.new("t", f"q{i}", model="sim-small", max_tokens=15) for i in range(32)]
                done = await asyncio.gather(*(backend.complete(r) for r in reqs))
            finally:
                await backend.close()
            return done, sim.engine.max_waiting_seen, sim.engine.max_running_seen

    return asyncio.run(go())


def test_pacing_keeps_the_servers_queue_near_empty_and_its_slots_full():
    done, max_waiting, max_running = _burst(paced=True)
    assert len(done) == 32 and all(c.completion_tokens == 15 for c in done)
    assert max_running == 4
    assert max_waiting <= 2  # probing one slot past the learned capacity lets one wait at times
    _, unpaced_waiting, _ = _burst(paced=False)
    assert unpaced_waiting >= 20  # without pacing the burst queues in the server's FIFO


def test_capacity_says_how_many_more_can_start_now():
    async def go():
        async with _sim(slots=3, ms_per_token=20) as sim:
            backend = OpenAIBackend(sim.base_url, pacing=PacingConfig(initial_limit=3))
            try:
                before = backend.capacity("sim-small")
                tasks = [asyncio.create_task(backend.complete(Request.new("t", f"q{i}", model="sim-small",
                                                                          max_tokens=40))) for i in range(6)]
                deadline = time.monotonic() + 3
                while backend.server_state()[0]["in_flight"] < 4 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.2)  # a few more samples: nothing more may start
                during = backend.capacity("sim-small")
                state = backend.server_state()[0]
                waiting = sim.engine.num_waiting
                await asyncio.gather(*tasks)
            finally:
                await backend.close()
            return before, during, state, waiting

    before, during, state, waiting = asyncio.run(go())
    assert before == 3
    # Three slots full and nobody waiting made it probe one more; that one waiting there
    # showed the server has three: nothing more starts, the last two wait in llmq.
    assert during == 0 and state["mode"] == "metrics"
    assert state["in_flight"] == 4 and waiting == 1


def test_models_route_to_their_own_servers_and_fail_over_when_one_dies():
    async def go():
        big1, big2, small = _sim(names=("big",)), _sim(names=("big",)), _sim(names=("small",))
        async with big1, big2, small:
            table = RoutingTable({"big": [big1.base_url, big2.base_url], "small": [small.base_url]})
            backend = OpenAIBackend(routes=table, backoff_s=0.05)
            try:
                first = await asyncio.gather(*(backend.complete(Request.new("t", f"b{i}", model="big",
                                                                            max_tokens=3)) for i in range(8)))
                degraded = await asyncio.gather(*(backend.complete(Request.new("t", f"s{i}", model="small",
                                                                               max_tokens=3)) for i in range(4)))
                seen = (big1.requests_seen, big2.requests_seen, small.requests_seen)
                await big1.stop()
                started = time.monotonic()
                after = await asyncio.gather(*(backend.complete(Request.new("t", f"a{i}", model="big",
                                                                            max_tokens=3)) for i in range(6)))
                took = time.monotonic() - started
                with pytest.raises(BackendError, match="unknown model 'huge'"):
                    await backend.complete(Request.new("t", "x", model="huge"))
            finally:
                await backend.close()
            return first, degraded, after, seen, big2.requests_seen, took

    first, degraded, after, seen, big2_total, took = asyncio.run(go())
    assert all(c.model == "big" for c in first + after) and all(c.model == "small" for c in degraded)
    assert seen[0] > 0 and seen[1] > 0 and seen[2] == 4  # spread over big's two; small to its own
    assert big2_total - seen[1] == 6  # every call after big1 died went to big2
    assert took < 2.0


def test_a_cancelled_stream_leaves_the_simulators_batch():
    async def go():
        async with _sim(slots=2, ms_per_token=10) as sim:
            backend = OpenAIBackend(sim.base_url)
            got = asyncio.Event()

            async def consume():
                async for _ in backend.stream(Request.new("t", "long", model="sim-small", max_tokens=400)):
                    got.set()

            task = asyncio.create_task(consume())
            try:
                await asyncio.wait_for(got.wait(), 5)
                running_before = sim.engine.num_running
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                deadline = time.monotonic() + 2
                while sim.engine.num_running and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                return running_before, sim.engine.num_running, sim.disconnects
            finally:
                await backend.close()

    before, after, disconnects = asyncio.run(go())
    assert (before, after, disconnects) == (1, 0, 1)


def test_a_cancelled_whole_answer_leaves_the_simulators_batch_too():
    # What a worker does to a call it preempts for a higher band's request.
    async def go():
        async with _sim(slots=2, ms_per_token=10) as sim:
            backend = OpenAIBackend(sim.base_url)
            task = asyncio.create_task(backend.complete(Request.new("t", "long", model="sim-small",
                                                                    max_tokens=400)))
            try:
                deadline = time.monotonic() + 5
                while sim.engine.num_running == 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                deadline = time.monotonic() + 2
                while sim.engine.num_running and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                return sim.engine.num_running, sim.disconnects, backend.server_state()[0]["in_flight"]
            finally:
                await backend.close()

    assert asyncio.run(go()) == (0, 1, 0)
