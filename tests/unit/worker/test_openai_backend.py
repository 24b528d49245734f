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
