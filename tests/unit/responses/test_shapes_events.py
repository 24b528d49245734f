"""The Responses API's pure parts: the create body checked, the response object, the stream's
event sequence (the same from a replay), a chain's model input, the record's replace rule."""

from __future__ import annotations

import pytest

from pipeline.models import Priority, Response, Status
from pipeline.openai_api.errors import ApiError
from pipeline.openai_api.responses import finish, input_items_page, model_messages, parse_create, render, with_ids
from pipeline.responses import record as R
from pipeline.responses.events import Events, sse


def _rec(**kw) -> R.StoredResponse:
    base = dict(id="resp_" + "a" * 32, tenant="acme", created_at=1, model="m")
    return R.StoredResponse(**{**base, **kw})


def test_input_as_a_string_or_message_items():
    p = parse_create({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 5})
    assert p.input == [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    assert (p.instructions, p.max_output_tokens, p.store, p.background) == ("be brief", 5, True, False)
    p = parse_create({"input": [{"role": "developer", "content": "rules"},
                                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]}]})
    assert [i["role"] for i in p.input] == ["developer", "user"]


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
    ({"input": "x", "service_tier": "scale"}, "service_tier"),
    ({"input": "x", "background": True, "store": False}, "store"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m"}, "input"),
])
def test_what_llmq_cannot_honour_is_a_400_naming_it(body, param):
    with pytest.raises(ApiError) as err:
        parse_create(body)
    assert err.value.status == 400 and err.value.param == param


def test_a_chain_becomes_the_history_then_the_new_input():
    first = _rec(input=with_ids("resp_" + "a" * 32, parse_create({"input": "My name is Ada"}).input),
                 output_text="Hello Ada", instructions="old rules", status=R.COMPLETED)
    new = parse_create({"input": "What is my name?"}).input
    assert model_messages([first], new, "be brief") == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "My name is Ada"},
        {"role": "assistant", "content": "Hello Ada"}, {"role": "user", "content": "What is my name?"}]


def test_finish_maps_the_pipeline_answer():
    rec = _rec(status=R.IN_PROGRESS)
    done = Response(request_id="r", tenant_id="acme", status=Status.COMPLETED, output="hi", prompt_tokens=3,
                    completion_tokens=2, requested_priority=Priority.NORMAL, created_at=0, finished_at=0,
                    finish_reason="stop")
    out = finish(rec, done, "flex", 5)
    assert (out.status, out.output_text, out.served_tier, out.updated_ms) == (R.COMPLETED, "hi", "flex", 5)
    doc = render(out)
    assert doc["output"][0]["content"][0]["text"] == "hi" and doc["service_tier"] == "flex"
    assert doc["usage"]["input_tokens"] == 3 and doc["usage"]["total_tokens"] == 5
    cut = finish(rec, Response(**{**_fields(done), "finish_reason": "length"}), "default", 6)
    assert cut.status == R.INCOMPLETE and render(cut)["incomplete_details"] == {"reason": "max_output_tokens"}
    failed = finish(rec, Response(**{**_fields(done), "status": Status.FAILED, "reason": "backend_error: boom"}),
                    "default", 7)
    assert failed.status == R.FAILED and failed.error["code"] == "backend_error"
    expired = finish(rec, Response(**{**_fields(done), "status": Status.EXPIRED}), "default", 8)
    assert expired.error["code"] == "expired"


def _fields(resp: Response) -> dict:
    return {f: getattr(resp, f) for f in resp.__dataclass_fields__}


def test_the_event_sequence_is_numbered_and_the_same_when_replayed():
    rec = _rec()
    final = _rec(status=R.COMPLETED, output_text="ab", usage={"input_tokens": 1, "output_tokens": 2})

    def run():
        ev = Events(rec)
        return ev.opening() + [ev.delta("a"), ev.delta(""), ev.delta("b")] + ev.closing(final)

    events = [e for e in run() if e is not None]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[0]["response"]["status"] == "queued" and events[-1]["response"]["usage"]["output_tokens"] == 2
    again = [e for e in run() if e is not None]
    assert again == events  # a replay numbers each event as the first stream did
    assert sse(events[0]).startswith(b"event: response.created\ndata: {")
    failed = Events(rec)
    failed.opening()
    assert [e["type"] for e in failed.closing(_rec(status=R.CANCELLED))] == ["response.failed"]


def test_a_record_that_ended_is_not_replaced_by_one_that_has_not():
    done, running = _rec(status=R.COMPLETED, updated_ms=1), _rec(status=R.IN_PROGRESS, updated_ms=9)
    assert not running.replaces(done) and done.replaces(running)
    assert _rec(status=R.QUEUED, updated_ms=2).replaces(_rec(status=R.QUEUED, updated_ms=1))
    assert R.StoredResponse.from_json(done.to_json()) == done


def test_input_items_pages():
    rec = _rec(input=with_ids("resp_" + "a" * 32, parse_create({"input": [{"role": "user", "content": str(i)}
                                                                           for i in range(3)]}).input))
    page = input_items_page(rec, limit=2)
    assert [i["content"][0]["text"] for i in page["data"]] == ["2", "1"] and page["has_more"]
    rest = input_items_page(rec, after=page["last_id"], limit=2)
    assert [i["content"][0]["text"] for i in rest["data"]] == ["0"] and not rest["has_more"]
