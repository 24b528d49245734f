import asyncio
import time

import pytest

from pipeline.errors import BackendError
from pipeline.models import Request
from pipeline.worker.backends.openai_http import OpenAIBackend
from tests.openai_stub import StubServer


def _run(backend: OpenAIBackend, request: Request):
    async def go():
        try:
            return await backend.complete(request)
        finally:
            await backend.close()
    return asyncio.run(go())


def test_a_chat_completion_returns_output_usage_and_the_serving_model():
    with StubServer() as server:
        c = _run(OpenAIBackend(server.url, "sk-test"), Request.new("t", "hi there", model="small-model", max_tokens=5))
    assert c.output == "echo: hi there"
    assert (c.prompt_tokens, c.completion_tokens, c.model) == (7, 3, "small-model")
    assert server.calls[0]["max_tokens"] == 5 and server.calls[0]["model"] == "small-model"
    assert server.auth[0] == "Bearer sk-test"


def test_429_and_5xx_are_retried_with_backoff_honouring_retry_after():
    script = [(429, {"error": "slow down"}, 0, {"retry-after": "0.2"}), (503, {"error": "busy"}, 0, {}),
              (200, None, 0, {})]
    with StubServer(script) as server:
        started = time.monotonic()
        c = _run(OpenAIBackend(server.url, max_attempts=3, backoff_s=0.05), Request.new("t", "retry me"))
    assert c.output == "echo: retry me"
    assert len(server.calls) == 3
    assert time.monotonic() - started >= 0.2  # waited as Retry-After asked


def test_a_backend_that_keeps_failing_ends_in_a_clear_error_after_n_attempts():
    with StubServer([(500, {"error": "boom"}, 0, {})]) as server:
        with pytest.raises(BackendError, match=r"HTTP 500.*after 3 attempts"):
            _run(OpenAIBackend(server.url, max_attempts=3, backoff_s=0.01), Request.new("t", "x"))
    assert len(server.calls) == 3


def test_client_errors_are_not_retried():
    with StubServer([(400, {"error": "bad model"}, 0, {})]) as server:
        with pytest.raises(BackendError, match="HTTP 400"):
            _run(OpenAIBackend(server.url, max_attempts=3), Request.new("t", "x"))
    assert len(server.calls) == 1


def test_timeouts_are_retried_then_reported():
    with StubServer([(200, None, 1.0, {})]) as server:
        with pytest.raises(BackendError, match=r"timed out.*after 2 attempts"):
            _run(OpenAIBackend(server.url, timeout_s=0.2, max_attempts=2, backoff_s=0.01), Request.new("t", "x"))


def test_a_call_never_outlives_the_requests_deadline():
    with StubServer([(200, None, 2.0, {})]) as server:
        started = time.monotonic()
        with pytest.raises(BackendError):
            _run(OpenAIBackend(server.url, timeout_s=30, max_attempts=5), Request.new("t", "x", timeout_ms=500))
    assert time.monotonic() - started < 1.5


def test_a_malformed_body_is_a_clear_error():
    with StubServer([(200, {"unexpected": True}, 0, {})]) as server:
        with pytest.raises(BackendError, match="unexpected response body"):
            _run(OpenAIBackend(server.url), Request.new("t", "x"))


def test_the_completion_says_why_generation_stopped():
    with StubServer() as server:
        c = _run(OpenAIBackend(server.url), Request.new("t", "hi"))
    assert c.finish_reason == "stop" and not c.usage_estimated
    assert server.calls[0]["stream"] is True  # asked for a stream; a whole JSON answer is read as one


def test_a_stream_from_a_server_that_answers_whole_is_one_chunk_and_the_last():
    async def go(url):
        backend = OpenAIBackend(url)
        try:
            return [c async for c in backend.stream(Request.new("t", "hi"))]
        finally:
            await backend.close()

    with StubServer() as server:
        chunks = asyncio.run(go(server.url))
    assert [c.text for c in chunks] == ["echo: hi", ""]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 3


def test_an_unknown_model_fails_without_any_http_call():
    from pipeline.worker.backends.routing import RoutingTable

    with StubServer() as server:
        backend = OpenAIBackend(routes=RoutingTable({"big": [server.url]}))
        with pytest.raises(BackendError, match="unknown model 'huge'") as info:
            _run(backend, Request.new("t", "x", model="huge"))
    assert not info.value.retriable and server.calls == []


def test_a_404_is_not_retried_and_is_named():
    body = {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404}}
    with StubServer([(404, body, 0, {})]) as server:
        with pytest.raises(BackendError, match=r"^HTTP 404: The model `x` does not exist\.$") as info:
            _run(OpenAIBackend(server.url, max_attempts=3), Request.new("t", "x", model="x"))
    assert not info.value.retriable and len(server.calls) == 1


def test_error_bodies_are_quoted_without_the_servers_paths():
    trace = {"error": {"message": 'boom in File "/opt/srv/.venv/lib/python3.11/site-packages/app.py", line 3\n'
                                  "Traceback (most recent call last): secret"}}
    with StubServer([(500, trace, 0, {})]) as server:
        with pytest.raises(BackendError) as info:
            _run(OpenAIBackend(server.url, max_attempts=2, backoff_s=0.01), Request.new("t", "x"))
    message = str(info.value)
    assert "HTTP 500" in message and "/opt/srv" not in message and "site-packages" not in message
    assert "Traceback" not in message and info.value.retriable


def test_a_failing_server_fails_over_to_another_of_the_model_at_once():
    from pipeline.worker.backends.routing import RoutingTable

    with StubServer([(503, {"error": "busy"}, 0, {"retry-after": "5"})]) as bad, StubServer() as good:
        async def go():
            backend = OpenAIBackend(routes=RoutingTable({"m": [bad.url, good.url]}), backoff_s=5.0)
            try:
                return [await backend.complete(Request.new("t", f"q{i}", model="m")) for i in range(3)]
            finally:
                await backend.close()

        started = time.monotonic()
        outputs = asyncio.run(go())
    assert [c.output for c in outputs] == ["echo: q0", "echo: q1", "echo: q2"]
    assert time.monotonic() - started < 2.0  # neither the backoff nor the Retry-After was waited
    assert len(bad.calls) <= 1  # held for its Retry-After after the first 503


def test_a_retry_after_past_the_deadline_fails_at_once():
    with StubServer([(429, {"error": "slow down"}, 0, {"retry-after": "30"})]) as server:
        started = time.monotonic()
        with pytest.raises(BackendError, match="would pass the request's deadline") as info:
            _run(OpenAIBackend(server.url, max_attempts=5), Request.new("t", "x", timeout_ms=3000))
    assert time.monotonic() - started < 1.0 and not info.value.retriable
