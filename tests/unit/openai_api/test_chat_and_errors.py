"""OpenAI request bodies to Request fields and back to OpenAI answers; the error table; kept results."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from pipeline.models import Chunk, Priority, Request, Response, Status
from pipeline.openai_api.chat import (CHAT, COMPLETION, DONE, chunk_events, parse_body, render, sse, usage_event)
from pipeline.openai_api.errors import ApiError, for_reason, for_response, retry_after_seconds
from pipeline.serve.results import ResultStore


def test_chat_bodies_with_text_parts_stop_strings_and_ignored_knobs():
    parsed = parse_body({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"}],
        "stop": "END", "temperature": 0, "top_p": 0.5, "seed": 7, "presence_penalty": 1, "user": "u-1",
        "max_completion_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}, CHAT, 256)
    assert parsed.fields["messages"] == [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "ab", "name": "ann"}]
    assert parsed.fields["stop"] == ["END"] and parsed.fields["temperature"] == 0.0
    assert parsed.fields["max_tokens"] == 9 and parsed.fields["user"] == "u-1"
    assert parsed.stream and parsed.include_usage and parsed.model == "m"
    assert "seed" not in parsed.fields


def test_completion_bodies_take_one_prompt_and_a_default_max_tokens():
    parsed = parse_body({"model": "m", "prompt": ["only one"], "metadata": {"priority": "high"}}, COMPLETION, 42)
    assert parsed.fields["prompt"] == "only one" and parsed.fields["max_tokens"] == 42
    assert parsed.priority is Priority.HIGH and "metadata" not in parsed.fields


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0]"),
    ({"model": 7, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": {"a": 1}}, "metadata"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": {"priority": "soon"}},
     "metadata.priority"),
])
def test_bodies_llmq_cannot_honour_are_400_naming_the_parameter(body, param):
    with pytest.raises(ApiError) as err:
        parse_body(body, CHAT, 256)
    assert err.value.status == 400 and err.value.param == param


def _done(req: Request) -> Response:
    return Response.for_request(req, Status.COMPLETED, output="out", model="sim-small", prompt_tokens=4,
                                completion_tokens=6, finish_reason="length")


def test_answers_and_stream_events_in_openais_shape():
    req = Request.new("t", "p")
    chat = render(CHAT, _done(req), "asked")
    assert chat["choices"][0]["finish_reason"] == "length" and chat["model"] == "sim-small"
    assert chat["usage"]["total_tokens"] == 10
    text = render(COMPLETION, _done(req), "asked")
    assert text["id"] == f"cmpl-{req.request_id}" and text["choices"][0]["text"] == "out"
    last = Chunk.for_request(req, 3, "end.", finish_reason="stop")
    events = chunk_events(CHAT, last, "m", 1)
    assert [e["choices"][0]["delta"] for e in events] == [{"content": "end."}, {}]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunk_events(CHAT, Chunk.for_request(req, 0, ""), "m", 1) == []
    assert usage_event(CHAT, _done(req), "m", 1)["choices"] == []
    assert sse({"a": 1}) == b'data: {"a":1}\n\n' and DONE == b"data: [DONE]\n\n"


@pytest.mark.parametrize("status, reason, http, code", [
    (Status.REJECTED, "rate_limited: limit a", 429, "rate_limit_exceeded"),
    (Status.REJECTED, "queue_full: band", 429, "queue_full"),
    (Status.REJECTED, "quota_exceeded: cap", 429, "quota_exceeded"),
    (Status.REJECTED, "invalid_request: prompt is empty", 400, "invalid_request"),
    (Status.REJECTED, "unauthorized: bad llmq-signature", 401, "unauthorized"),
    (Status.REJECTED, "forbidden: model", 403, "forbidden"),
    (Status.REJECTED, "duplicate_request_id: taken", 409, "duplicate_request_id"),
    (Status.REJECTED, "model_unavailable: no server", 404, "model_not_found"),
    (Status.REJECTED, "model_not_found: no server serves model 'x'", 404, "model_not_found"),
    (Status.EXPIRED, "expired: deadline passed", 504, "expired"),
    (Status.CANCELLED, "cancelled: by the client", 409, "cancelled"),
    (Status.FAILED, "backend_error: 500", 502, "backend_error"),
])
def test_every_answer_has_its_status(status, reason, http, code):
    error = for_response(Response.for_request(Request.new("t", "p"), status, reason=reason, retry_after_ms=2001))
    assert (error.status, error.code) == (http, code) and error.message == reason
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_retry_after_is_whole_seconds_rounded_up_and_429s_always_say_it():
    assert [retry_after_seconds(ms) for ms in (None, 0, 1, 1000, 1001, 2500)] == [None, None, 1, 1, 2, 3]
    assert for_reason("rate_limited: x", None).headers() == {"Retry-After": "1"}
    assert for_reason("invalid_request: x", None).headers() == {}
    assert for_response(Response.for_request(Request.new("t", "p"), Status.COMPLETED)) is None


def test_results_are_kept_per_tenant_for_their_ttl_and_up_to_their_count():
    now = [0.0]
    forgotten = []
    store = ResultStore(10.0, 2, forgotten.append, clock=lambda: now[0])
    for i in range(3):
        store.add(f"r{i}", "acme", CHAT, "m", "LOW", Future())
    assert forgotten == ["r0"] and len(store) == 2
    assert store.get("r1", "acme") is not None and store.get("r1", "beta") is None
    now[0] = 11.0
    assert store.get("r2", "acme") is None and forgotten == ["r0", "r1", "r2"]


def test_a_kept_result_reports_its_answer_once_there():
    fut: Future = Future()
    store = ResultStore(10.0, 5, lambda rid: None)
    entry = store.add("r", "acme", CHAT, "m", "LOW", fut)
    assert entry.response() is None and entry.error() is None
    answer = _done(Request.new("acme", "p"))
    fut.set_result(answer)
    assert entry.response() is answer


def test_a_body_without_a_model_runs_on_the_default():
    parsed = parse_body({"messages": [{"role": "user", "content": "x"}]}, CHAT, 16)
    assert parsed.model == ""
