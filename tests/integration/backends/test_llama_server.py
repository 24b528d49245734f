"""The OpenAI backend against a real llama.cpp server (llama-cpp-python) on a tiny random model."""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline.errors import BackendError
from pipeline.models import Request
from pipeline.worker.backends.openai_http import OpenAIBackend
from tests.integration.backends.fault_proxy import FaultProxy
from tests.llama.server import MODEL_ALIAS

pytestmark = pytest.mark.llama
GREEDY = {"temperature": 0.0, "seed": 1}


def _req(prompt: str = "hello there", max_tokens: int = 16, **kw) -> Request:
    return Request.new("t", prompt, model=MODEL_ALIAS, max_tokens=max_tokens, **kw)


def _backend(url: str, **kw) -> OpenAIBackend:
    kw.setdefault("params", GREEDY)
    return OpenAIBackend(url, **kw)


def test_a_chat_completion_is_completed_with_the_servers_usage(llama_server):
    async def go():
        backend = _backend(llama_server.base_url)
        try:
            # The first answer is streamed; this server's streams carry no usage, so the
            # backend asks it for whole answers from then on, whose usage is the server's.
            return await backend.complete(_req(max_tokens=16)), await backend.complete(_req(max_tokens=16))
        finally:
            await backend.close()

    first, second = asyncio.run(go())
    assert first.usage_estimated and first.completion_tokens == 16
    assert second.output == first.output and second.model == MODEL_ALIAS
    assert second.completion_tokens == 16 and second.prompt_tokens > 3 and not second.usage_estimated
    assert second.finish_reason == "length"


def test_stream_chunks_arrive_in_order_and_the_last_reports_usage(llama_server):
    async def go():
        backend = _backend(llama_server.base_url, stream_completions=False)
        try:
            whole = await backend.complete(_req("count with me", max_tokens=24))
            chunks = [c async for c in backend.stream(_req("count with me", max_tokens=24))]
            return whole, chunks
        finally:
            await backend.close()

    whole, chunks = asyncio.run(go())
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].last
    # Greedy decoding: the stream's pieces, in order, are the whole answer.
    assert "".join(c.text for c in chunks) == whole.output
    usage = chunks[-1].usage
    # This server reports no usage in streams: one token per chunk, which is what it sends.
    assert usage.estimated and usage.completion_tokens == whole.completion_tokens == 24
    assert chunks[-1].finish_reason == "length"


def test_cancelling_a_stream_stops_the_generation(llama_server):
    long_answer = 1800

    async def go():
        backend = _backend(llama_server.base_url)
        arrivals: list[float] = []
        enough = asyncio.Event()

        async def consume():
            async for _ in backend.stream(_req("a long story", max_tokens=long_answer)):
                arrivals.append(time.monotonic())
                if len(arrivals) == 60:
                    enough.set()

        task = asyncio.create_task(consume())
        try:
            await asyncio.wait_for(enough.wait(), 30)
            per_token = (arrivals[59] - arrivals[19]) / 40
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            started = time.monotonic()
            after = await asyncio.wait_for(backend.complete(_req(max_tokens=4)), 30)
            return per_token, time.monotonic() - started, after
        finally:
            task.cancel()
            await backend.close()

    per_token, next_took, after = asyncio.run(go())
    assert after.completion_tokens == 4
    # The server generates one request at a time: had it gone on, the next call would have
    # waited for the other ~1,700 tokens.
    assert next_took < per_token * (long_answer - 60) / 3
    deadline = time.monotonic() + 5
    while "Disconnected from client" not in llama_server.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "Disconnected from client" in llama_server.log_text()


def test_a_server_killed_mid_call_is_a_retriable_error_not_a_hang(own_llama_server):
    async def go():
        backend = _backend(own_llama_server.base_url, max_attempts=2, backoff_s=0.05, timeout_s=20)
        got: list = []
        try:
            with pytest.raises(BackendError) as mid_stream:
                async with asyncio.timeout(15):
                    async for chunk in backend.stream(_req("go on", max_tokens=1800)):
                        got.append(chunk)
                        if len(got) == 5:
                            own_llama_server.kill()
            started = time.monotonic()
            with pytest.raises(BackendError) as refused:
                await asyncio.wait_for(backend.complete(_req()), 15)
            return got, mid_stream.value, refused.value, time.monotonic() - started
        finally:
            await backend.close()

    got, mid_stream, refused, took = asyncio.run(go())
    assert len(got) >= 5 and mid_stream.retriable and "incomplete" in str(mid_stream)
    assert refused.retriable and "connection error" in str(refused) and "after 2 attempts" in str(refused)
    assert took < 5


@pytest.mark.parametrize("streamed", [False, True])
def test_429_and_503_in_front_of_the_server_are_retried_honouring_retry_after(llama_server, streamed):
    root = llama_server.base_url.removesuffix("/v1")

    async def go():
        async with FaultProxy(root, [(429, {"Retry-After": "0.4"}), (503, {})]) as proxy:
            backend = _backend(proxy.base_url, max_attempts=3, backoff_s=0.05)
            try:
                if streamed:
                    chunks = [c async for c in backend.stream(_req(max_tokens=8))]
                    result = ("".join(c.text for c in chunks), chunks[-1].usage.completion_tokens)
                else:
                    c = await backend.complete(_req(max_tokens=8))
                    result = (c.output, c.completion_tokens)
            finally:
                await backend.close()
            return result, proxy.calls

    (text, tokens), calls = asyncio.run(go())
    assert text and tokens == 8
    assert [status for _, status in calls] == [429, 503, 200]
    assert calls[1][0] - calls[0][0] >= 0.4  # waited as Retry-After asked


def test_a_prompt_longer_than_the_context_is_a_clear_non_retriable_error(llama_server):
    async def go():
        backend = _backend(llama_server.base_url, max_attempts=3)
        try:
            await backend.complete(_req("word " * 3000, max_tokens=8))
        finally:
            await backend.close()

    with pytest.raises(BackendError, match=r"HTTP 400: This model's maximum context length is 2048") as info:
        asyncio.run(go())
    assert not info.value.retriable


def test_the_servers_tracebacks_never_reach_the_error(llama_server):
    async def go():
        # llama-cpp-python answers a malformed parameter with a 500 quoting its own source files.
        backend = _backend(llama_server.base_url, max_attempts=1, params={"temperature": "hot"})
        try:
            await backend.complete(_req())
        finally:
            await backend.close()

    with pytest.raises(BackendError, match="HTTP 500") as info:
        asyncio.run(go())
    message = str(info.value)
    assert "site-packages" not in message and ".py" not in message and "\n" not in message
