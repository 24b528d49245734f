"""The OpenAI wire format: bodies, whole answers, server-sent events, quoted errors."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from pipeline.models import Request
from pipeline.worker.backends.openai_wire import (SseParser, StreamAssembler, WireError, chat_body, completion_from_json,
                                                  error_reason, quote, retry_after_s, sse_events)
from pipeline.worker.backends.server_metrics import parse_load


def test_a_request_without_messages_is_one_user_message_of_its_prompt():
    body = chat_body(Request.new("t", "hello", model="m", max_tokens=7), stream=True)
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["model"], body["max_tokens"]) == ("m", 7)


@dataclass
class _Msg:
    role: str
    content: str


class _LaterRequest:
    """What a later schema revision's request looks like to the client."""

    prompt = "unused"
    model = "m"
    max_tokens = 3
    temperature = 0.0
    top_p = None
    stop = ["\n"]
    messages = [_Msg("system", "be brief"), {"role": "user", "content": "hi", "name": None}]


def test_messages_and_sampling_fields_are_sent_when_the_request_has_them():
    body = chat_body(_LaterRequest(), stream=False, defaults={"temperature": 0.7, "seed": 1})
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert body["temperature"] == 0.0 and body["stop"] == ["\n"] and body["seed"] == 1
    assert "top_p" not in body and "stream" not in body


def _sse(*events) -> list[str]:
    lines = [": ping"]
    for e in events:
        lines += [f"data: {e if isinstance(e, str) else json.dumps(e)}", ""]
    return lines


def _delta(text=None, finish=None, usage=None):
    choice = {"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": finish}
    event = {"choices": [choice], "model": "m"}
    if usage:
        event["usage"] = usage
    return event


def test_a_stream_becomes_ordered_chunks_and_a_last_one_with_the_servers_usage():
    asm = StreamAssembler(prompt_tokens_estimate=99)
    events = _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                  _delta("Hel"), _delta("lo"), _delta(" you", "length"),
                  {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}, "[DONE]")
    chunks = [c for c in map(asm.feed, sse_events(events)) if c is not None]
    assert [(c.index, c.text) for c in chunks] == [(0, "Hel"), (1, "lo"), (2, " you")]
    assert asm.complete
    last = asm.finish()
    assert last.index == 3 and last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.estimated) == (4, 3, False)


def test_without_usage_in_the_stream_it_is_estimated_one_token_per_chunk():
    asm = StreamAssembler(prompt_tokens_estimate=12)
    for data in sse_events(_sse(_delta("a"), _delta("b"), _delta(None, "stop"), "[DONE]")):
        asm.feed(data)
    usage = asm.finish().usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.estimated) == (12, 2, True)


def test_a_stream_cut_short_is_not_complete():
    asm = StreamAssembler(1)
    for data in sse_events(_sse(_delta("a"))):
        asm.feed(data)
    assert not asm.complete


def test_an_error_event_mid_stream_is_a_wire_error():
    asm = StreamAssembler(1)
    with pytest.raises(WireError, match="failed mid-stream: out of memory") as info:
        asm.feed(json.dumps({"error": {"message": "out of memory", "code": 500}}))
    assert info.value.retriable


def test_multi_line_events_are_joined():
    assert list(sse_events(["data: a", "data: b", "", "data: c"])) == ["a\nb", "c"]


def test_a_whole_answer_keeps_finish_reason_and_estimates_missing_usage():
    c = completion_from_json({"model": "m", "choices": [{"message": {"content": "12345678"},
                                                         "finish_reason": "stop"}]}, Request.new("t", "x"))
    assert (c.output, c.finish_reason, c.usage_estimated, c.completion_tokens) == ("12345678", "stop", True, 2)
    with pytest.raises(WireError, match="unexpected response body"):
        completion_from_json({"nope": 1}, Request.new("t", "x"))


def test_errors_are_quoted_as_one_short_line_without_server_paths():
    body = json.dumps({"error": {"message": "1 validation error:\n  File \"/srv/app/.venv/lib/python3.11/"
                                            "site-packages/llama_cpp/server/app.py\", line 376"}})
    reason = error_reason(500, body)
    assert reason == "HTTP 500: 1 validation error:"
    assert "/srv" not in error_reason(500, "Traceback in /srv/app/.venv/lib/x.py and C:\\models\\x.gguf")
    assert "C:\\models" not in error_reason(500, "failed to open C:\\models\\x.gguf")
    assert len(quote("x" * 5000)) == 200
    assert error_reason(404, '{"error": {"message": "The model `x` does not exist.", "code": 404}}') == \
        "HTTP 404: The model `x` does not exist."
    assert error_reason(502, b"") == "HTTP 502"


def test_retry_after_is_seconds_or_an_http_date():
    assert retry_after_s("1.5", 0) == 1.5
    assert retry_after_s("Wed, 21 Oct 2015 07:28:10 GMT", 1445412480.0) == pytest.approx(10.0)
    assert retry_after_s("soon", 0) is None and retry_after_s(None, 0) is None
    assert retry_after_s("-4", 0) == 0.0


def test_server_load_is_read_from_vllm_and_llama_cpp_metrics():
    vllm = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="big"} 3.0
vllm:num_requests_running{engine="1",model_name="big"} 2.0
vllm:num_requests_waiting{engine="0",model_name="big"} 1.0
vllm:kv_cache_usage_perc{model_name="big"} 0.25
vllm:num_requests_waiting_by_reason{reason="x"} 7
"""
    load = parse_load(vllm, at=5.0)
    assert (load.running, load.waiting, load.kv_usage, load.at) == (5.0, 1.0, 0.25, 5.0)
    llama = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 4\n"
    assert (parse_load(llama, 0).running, parse_load(llama, 0).waiting) == (1.0, 4.0)
    assert parse_load("process_cpu_seconds_total 3\n", 0) is None


def test_events_split_anywhere_across_reads_come_out_whole_and_in_order():
    body = 'data: {"a": 1}\r\n\r\n: ping\n\ndata: {"b": "é"}\n\ndata: [DONE]\n\n'.encode()
    for cut in range(1, len(body)):
        parser = SseParser()
        events = parser.feed(body[:cut]) + parser.feed(body[cut:])
        tail = parser.close()
        assert events + ([tail] if tail else []) == ['{"a": 1}', '{"b": "é"}', "[DONE]"], cut


def test_a_body_that_ends_without_its_blank_line_still_gives_its_last_event():
    parser = SseParser()
    assert parser.feed(b"data: last") == []
    assert parser.close() == "last"


def test_an_endless_line_is_refused_not_buffered():
    parser = SseParser()
    with pytest.raises(WireError):
        parser.feed(b"x" * (SseParser.MAX_LINE_BYTES + 1))
