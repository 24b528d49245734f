"""Requests through a real worker, a real broker and a real model server: llama.cpp
(llama-cpp-python on a tiny random model), and the project's vLLM-like simulator in its own
process for the scheduling test that needs a server with many slots.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from confluent_kafka import Producer

from pipeline.cancellations import cancellation_record
from pipeline.models import Priority, Request, Status
from pipeline.serde import Codec
from pipeline.simulator.process import SimulatorProcess
from pipeline.chunks import ChunkReader
from pipeline.worker.backends.factory import make_backend
from tests.integration.backends.fault_proxy import FaultProxy
from tests.integration.harness import read_topic, running_worker
from tests.llama.fixtures import llama_model, llama_server, own_llama_server  # noqa: F401
from tests.llama.server import MODEL_ALIAS

CODEC = Codec.default()


def _openai(settings, base_url: str, **worker) -> None:
    w = settings.worker
    w.backend, w.openai_base_url = "openai", base_url
    w.backend_timeout_s, w.backend_max_attempts = 30.0, 3
    for k, v in worker.items():
        setattr(w, k, v)


def _submit(settings, *requests: Request) -> None:
    producer = Producer(settings.kafka.producer_config())
    for r in requests:
        producer.produce(settings.topics.request_topic(r.priority), CODEC.encode_request(r), r.tenant_id.encode())
    assert producer.flush(30) == 0


def _answers(settings, ids: set[str], timeout: float = 120.0, settle_s: float = 0.0) -> dict:
    """Every response to ``ids`` once each has one; with ``settle_s``, read again after that long
    (a second answer would have arrived by then). id → list of responses."""
    def enough(msgs):
        return ids <= {CODEC.decode_response(m.value()).request_id for m in msgs}

    read_topic(settings.kafka.bootstrap, settings.topics.responses, until=enough, timeout=timeout)
    if settle_s:
        time.sleep(settle_s)
    out: dict = {}
    for m in read_topic(settings.kafka.bootstrap, settings.topics.responses, timeout=30):
        r = CODEC.decode_response(m.value())
        out.setdefault(r.request_id, []).append((m.partition(), r))
    return {i: [r for _, r in out.get(i, [])] for i in ids} | {"_partitions": {
        i: [p for p, _ in out.get(i, [])] for i in ids}}


def _req(prompt="hello there", max_tokens=16, **kw) -> Request:
    kw.setdefault("priority", Priority.NORMAL)
    return Request.new("tenant-real", prompt, model=MODEL_ALIAS, max_tokens=max_tokens, timeout_ms=120_000,
                       temperature=0.0, **kw)


@pytest.mark.llama
def test_requests_are_completed_by_the_model_with_their_usage_counted(settings, llama_server):
    _openai(settings, llama_server.base_url)
    requests = [_req(f"question {i}", max_tokens=12) for i in range(3)]
    with running_worker(settings, make_backend(settings.worker)) as worker:
        _submit(settings, requests[0])  # what it learns from the first answer applies to the next ones
        _answers(settings, {requests[0].request_id})
        _submit(settings, *requests[1:])
        got = _answers(settings, {r.request_id for r in requests})
        metrics = worker.metrics
    responses = [got[r.request_id][0] for r in requests]
    assert all(r.status is Status.COMPLETED and r.output for r in responses), [r.reason for r in responses]
    assert all(r.completion_tokens == 12 and r.prompt_tokens > 0 and r.finish_reason == "length" for r in responses)
    # This server's streams carry no usage: the first answer's is estimated (and says so), the
    # next ones are asked for whole, with the server's own counts.
    assert responses[0].usage_estimated and not any(r.usage_estimated for r in responses[1:])
    counted = metrics.tokens.labels("NORMAL", "completion").value
    assert counted == sum(r.completion_tokens for r in responses)


@pytest.mark.llama
def test_a_streamed_request_sends_its_text_in_order_and_one_answer_with_all_of_it(settings, llama_server):
    _openai(settings, llama_server.base_url)
    request = _req("count with me", max_tokens=24, stream=True)
    with ChunkReader(settings) as reader, running_worker(settings, make_backend(settings.worker)) as worker:
        _submit(settings, request)
        chunks = list(reader.stream(request.request_id, timeout_s=60))
        got = _answers(settings, {request.request_id}, settle_s=1.0)
        ttft = worker.metrics.ttft.labels("NORMAL")
    (response,) = got[request.request_id]
    assert response.status is Status.COMPLETED
    assert [c.seq for c in chunks] == list(range(len(chunks))) and len(chunks) >= 2
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert response.output == "".join(c.delta for c in chunks)
    assert response.completion_tokens == 24 and response.usage_estimated and response.finish_reason == "length"
    assert sum(ttft.counts) == 1
    # The worker computes the chunk partition as librdkafka partitions the response: the same.
    (partition,) = got["_partitions"][request.request_id]
    chunk_msgs = read_topic(settings.kafka.bootstrap, settings.topics.chunks, timeout=30)
    assert {m.partition() for m in chunk_msgs} == {partition}


@pytest.mark.llama
def test_a_stream_cancelled_midway_stops_the_generation_and_is_answered_cancelled(settings, llama_server):
    _openai(settings, llama_server.base_url)
    long = _req("a long story", max_tokens=1800, stream=True)
    with ChunkReader(settings) as reader, running_worker(settings, make_backend(settings.worker)):
        _submit(settings, long)
        seen = 0
        for _ in reader.stream(long.request_id, timeout_s=60):
            seen += 1
            if seen == 20:
                break
        producer = Producer(settings.kafka.producer_config())
        key, value = cancellation_record(long.request_id, "the user closed the tab")
        producer.produce(settings.topics.cancellations, value, key)
        assert producer.flush(10) == 0
        got = _answers(settings, {long.request_id}, settle_s=0.5)
        # The server runs one generation at a time: a short request is answered at once only
        # if the long one stopped.
        quick = _req("quick", max_tokens=4)
        started = time.monotonic()
        _submit(settings, quick)
        after = _answers(settings, {quick.request_id}, timeout=60)
        took = time.monotonic() - started
    (response,) = got[long.request_id]
    assert response.status is Status.CANCELLED and response.reason == "cancelled: the user closed the tab"
    assert after[quick.request_id][0].status is Status.COMPLETED
    assert took < 20
    deadline = time.monotonic() + 5
    while "Disconnected from client" not in llama_server.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "Disconnected from client" in llama_server.log_text()


@pytest.mark.llama
def test_a_server_killed_mid_call_leaves_each_request_one_answer_never_none(settings, own_llama_server):
    _openai(settings, own_llama_server.base_url, backend_max_attempts=2, backend_timeout_s=10.0)
    streamed = _req("go on", max_tokens=1800, stream=True)
    # The server takes one call at a time: these wait behind the streamed one when it is killed.
    whole = [_req(f"and then {i}", max_tokens=1800) for i in range(3)]
    with ChunkReader(settings) as reader, running_worker(settings, make_backend(settings.worker)):
        _submit(settings, streamed, *whole)
        for _ in reader.stream(streamed.request_id, timeout_s=60):
            own_llama_server.kill()  # at the first chunk seen: the tiny model may finish a call in a second
            break
        got = _answers(settings, {streamed.request_id} | {r.request_id for r in whole}, timeout=120, settle_s=2.0)
    failed = []
    for r in [streamed, *whole]:
        (response,) = got[r.request_id]  # exactly one
        assert response.status in (Status.COMPLETED, Status.FAILED), response  # finished before the kill, or not
        if response.status is Status.FAILED:
            failed.append(r.request_id)
            assert response.reason.startswith("backend_error: ")
            assert "connection" in response.reason and "/" not in response.reason.split(":", 1)[1].replace(
                "http://", "")
    assert len(failed) >= 2, "the kill came after most calls had finished"
    if streamed.request_id in failed:
        assert "incomplete" in got[streamed.request_id][0].reason  # cut mid-stream, and said so


class _ThreadedProxy:
    """FaultProxy on an event loop of its own, for a test whose worker runs in another thread."""

    def __init__(self, upstream_root: str, script):
        self.proxy = FaultProxy(upstream_root, script)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.__aenter__(), self.loop).result(10)
        return self.proxy

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.__aexit__(None, None, None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.mark.llama
def test_429_and_503_from_the_server_are_retried_then_answered(settings, llama_server):
    root = llama_server.base_url.removesuffix("/v1")
    with _ThreadedProxy(root, [(429, {"Retry-After": "0.3"}), (503, {})]) as proxy:
        _openai(settings, proxy.base_url)
        request = _req(max_tokens=8)
        with running_worker(settings, make_backend(settings.worker)):
            _submit(settings, request)
            got = _answers(settings, {request.request_id}, settle_s=0.5)
        calls = list(proxy.calls)
    (response,) = got[request.request_id]
    assert response.status is Status.COMPLETED and response.completion_tokens == 8
    assert [status for _, status in calls] == [429, 503, 200]
    assert calls[1][0] - calls[0][0] >= 0.3


@pytest.mark.llama
def test_a_model_without_a_server_is_failed_at_once(settings, llama_server):
    _openai(settings, llama_server.base_url, openai_routes=f"{MODEL_ALIAS}={llama_server.base_url}")
    lost = Request.new("tenant-real", "hi", model="gpt-unknown", max_tokens=4, timeout_ms=60_000)
    with running_worker(settings, make_backend(settings.worker)):
        started = time.monotonic()
        _submit(settings, lost)
        got = _answers(settings, {lost.request_id})
        took = time.monotonic() - started
    (response,) = got[lost.request_id]
    assert response.status is Status.FAILED and response.reason == "model_unavailable: no server for model gpt-unknown"
    assert took < 10


# -- the simulator: a server with many slots --------------------------------------------------


def test_a_critical_request_during_a_background_backlog_waits_about_one_slot_time_not_the_queue(settings):
    sim = SimulatorProcess("--served-model-name", "sim-small", "--max-num-seqs", "16", "--ttft-ms", "20",
                            "--ms-per-token", "5")
    try:
        # No preemption: what keeps CRITICAL from waiting behind the backlog is that the backlog
        # waits in llmq's band queues, not in the server's first-come queue.
        _openai(settings, sim.base_url, max_inflight=64, preempt_bands=[], backend_initial_inflight=16)
        tokens = 32
        background = [Request.new(f"bulk-{i % 4}", f"job {i}", priority=Priority.BACKGROUND, model="sim-small",
                                  max_tokens=tokens, timeout_ms=300_000) for i in range(48)]
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                samples.append((time.monotonic(), *sim.load()))
                time.sleep(0.02)

        with running_worker(settings, make_backend(settings.worker)):
            warm = Request.new("warm", "w", model="sim-small", max_tokens=1, timeout_ms=60_000)
            _submit(settings, warm)
            _answers(settings, {warm.request_id})
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            _submit(settings, *background)
            time.sleep(1.0)  # the backlog is queued, every slot busy
            urgent = Request.new("urgent", "now", priority=Priority.CRITICAL, model="sim-small",
                                 max_tokens=tokens, timeout_ms=60_000)
            _submit(settings, urgent)
            got = _answers(settings, {urgent.request_id} | {r.request_id for r in background}, timeout=180)
            stop.set()
            watcher.join(5)
    finally:
        sim.stop()
    crit = got[urgent.request_id][0]
    assert crit.status is Status.COMPLETED
    finished = sorted(r.finished_at - r.started_at for rs in (got[b.request_id] for b in background) for r in rs)
    service_ms = finished[len(finished) // 2]  # one request's time in the server (median)
    wait_ms = crit.started_at - crit.created_at
    assert wait_ms <= 1.5 * service_ms + 100, (wait_ms, service_ms)
    busy = [(running, waiting) for _, running, waiting in samples if running > 0]
    assert busy, "the watcher saw no load"
    # llmq never hands the server more than its slots (16, and one more while it probes for a
    # 17th): the backlog waits in llmq's band queues. What the server shows waiting is only what
    # arrived during a step, which lasts 20 ms per request joining it.
    assert max(r + w for r, w in busy) <= 16 + 1, sorted(busy, key=sum)[-10:]
    assert max(r for r, _ in busy) == 16
