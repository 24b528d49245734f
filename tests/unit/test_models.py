"""Tests of pipeline.models: enums, dataclasses and their record conversions."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from pathlib import Path

import pytest

from pipeline.models import (
    TERMINAL_STATUSES,
    Chunk,
    Priority,
    Request,
    Response,
    Status,
    TaskTier,
    now_ms,
    render_conversation,
)

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def _schema(name: str) -> dict:
    return json.loads((SCHEMAS / f"{name}.avsc").read_text())


def _enum_symbols(schema: dict, enum_name: str) -> list[str]:
    for f in schema["fields"]:
        types = f["type"] if isinstance(f["type"], list) else [f["type"]]
        for t in types:
            if isinstance(t, dict) and t.get("type") == "enum" and t["name"] == enum_name:
                return t["symbols"]
    raise AssertionError(f"no enum {enum_name}")


# -- enums ---------------------------------------------------------------------


def test_priority_ranks_follow_declaration_order():
    assert [(p.name, p.rank) for p in Priority] == [
        ("CRITICAL", 0),
        ("HIGH", 1),
        ("NORMAL", 2),
        ("LOW", 3),
        ("BACKGROUND", 4),
    ]


@pytest.mark.parametrize(
    ("enum_cls", "schema", "enum_name"),
    [
        (Priority, "llm_request", "Priority"),
        (TaskTier, "llm_request", "TaskTier"),
        (Status, "llm_response", "Status"),
        (Priority, "llm_response", "Priority"),
    ],
)
def test_enums_mirror_schema_symbols(enum_cls, schema, enum_name):
    assert [m.value for m in enum_cls] == _enum_symbols(_schema(schema), enum_name)
    assert all(m.value == m.name for m in enum_cls)


def test_queued_is_the_only_non_terminal_status():
    assert [s for s in Status if not s.is_terminal] == [Status.QUEUED]
    assert TERMINAL_STATUSES == {s for s in Status if s.is_terminal}
    assert Status.QUEUED not in TERMINAL_STATUSES and Status.COMPLETED in TERMINAL_STATUSES


def test_status_symbols_only_grow_at_the_end():
    # Revision 1's indexes must keep their meaning: QUEUED was appended.
    old = _enum_symbols(json.loads((SCHEMAS / "history" / "llm_response.1.avsc").read_text()), "Status")
    assert [s.value for s in Status][: len(old)] == old


def test_status_enum_default_is_a_non_terminal_symbol():
    status = next(f["type"] for f in _schema("llm_response")["fields"] if f["name"] == "status")
    assert Status(status["default"]) is Status.QUEUED


@pytest.mark.parametrize("text", ["high", "HIGH", " High ", "hIgH\n"])
def test_priority_parse_is_case_insensitive(text):
    assert Priority.parse(text) is Priority.HIGH


def test_parse_returns_members_unchanged():
    assert Priority.parse(Priority.LOW) is Priority.LOW
    assert Status.parse("failed") is Status.FAILED
    assert TaskTier.parse("realtime") is TaskTier.REALTIME


@pytest.mark.parametrize("bad", ["urgent", "", "HIGHEST", None, 3])
def test_priority_parse_rejects_unknown_names_listing_valid_ones(bad):
    with pytest.raises(ValueError) as info:
        Priority.parse(bad)
    for name in ("CRITICAL", "HIGH", "NORMAL", "LOW", "BACKGROUND"):
        assert name in str(info.value)


def test_enums_are_strings_and_print_as_symbols():
    assert isinstance(Priority.HIGH, str)
    assert Priority.HIGH == "HIGH"
    assert str(Priority.HIGH) == "HIGH"
    assert f"{Status.EXPIRED}" == "EXPIRED"
    assert f"{TaskTier.ASYNC:>6}" == " ASYNC"
    assert json.dumps({"p": Priority.LOW}) == '{"p": "LOW"}'


# -- Request -------------------------------------------------------------------


def test_request_fields_mirror_schema_in_order():
    names = [f.name for f in dataclasses.fields(Request)]
    assert names == [f["name"] for f in _schema("llm_request")["fields"]]


def test_response_fields_mirror_schema_in_order():
    names = [f.name for f in dataclasses.fields(Response)]
    assert names == [f["name"] for f in _schema("llm_response")["fields"]]


def test_chunk_fields_mirror_schema_in_order():
    names = [f.name for f in dataclasses.fields(Chunk)]
    assert names == [f["name"] for f in _schema("llm_chunk")["fields"]]


@pytest.mark.parametrize("cls, schema", [(Request, "llm_request"), (Response, "llm_response"), (Chunk, "llm_chunk")])
def test_dataclass_defaults_are_the_schema_defaults(cls, schema):
    defaults = {f["name"]: f["default"] for f in _schema(schema)["fields"] if "default" in f}
    for f in dataclasses.fields(cls):
        if f.name not in defaults:
            assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, f.name
            continue
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert value == defaults[f.name], f.name


def test_dataclasses_use_slots():
    req = Request.new("t", "p")
    with pytest.raises(AttributeError):
        req.not_a_field = 1  # type: ignore[attr-defined]
    assert not hasattr(req, "__dict__")


def test_request_new_fills_id_timestamp_and_defaults():
    before = now_ms()
    req = Request.new("tenant", "hello")
    after = now_ms()
    assert uuid.UUID(req.request_id).version == 4
    assert before <= req.created_at <= after
    assert isinstance(req.created_at, int)
    assert req.priority is Priority.NORMAL
    assert (req.model, req.max_tokens, req.timeout_ms) == ("", 256, 60_000)  # "": the default model
    assert (req.user_tier, req.task_tier, req.allow_degrade) == ("standard", TaskTier.ASYNC, False)
    assert (req.notify_queued, req.trace_id, req.metadata) == (False, None, {})
    assert req.deadline_ms == req.created_at + 60_000


def test_request_new_takes_optional_fields_and_names():
    req = Request.new(
        "tenant",
        "hello",
        priority="critical",
        max_tokens=5,
        task_tier="background",
        trace_id="tr",
        metadata={"a": "b"},
        request_id="fixed",
        created_at=42,
    )
    assert req.priority is Priority.CRITICAL
    assert req.task_tier is TaskTier.BACKGROUND
    assert (req.request_id, req.created_at, req.trace_id, req.metadata) == ("fixed", 42, "tr", {"a": "b"})


def test_request_new_takes_gateway_fields():
    req = Request.new("t", "p", admitted_at=7, effective_priority="low", degraded_from="sim-large")
    assert (req.admitted_at, req.effective_priority, req.degraded_from) == (7, Priority.LOW, "sim-large")
    plain = Request.new("t", "p")
    assert (plain.admitted_at, plain.effective_priority, plain.degraded_from) == (None, None, None)
    assert plain.serving_priority is Priority.NORMAL and req.serving_priority is Priority.LOW


def test_request_positional_construction_is_unchanged_by_revision_3():
    # The revision 3 fields come after metadata, so the 14 positional arguments of
    # revision 2 still land where they did.
    req = Request("id", "t", Priority.HIGH, "p", "m", 1, 2, 3, "gold", TaskTier.REALTIME, True, True, "tr", {"k": "v"})
    assert req.metadata == {"k": "v"} and req.admitted_at is None


def test_request_new_rejects_unknown_fields_and_priorities():
    with pytest.raises(TypeError):
        Request.new("t", "p", colour="red")
    with pytest.raises(ValueError):
        Request.new("t", "p", priority="urgent")


def test_request_ids_are_unique():
    assert len({Request.new("t", "p").request_id for _ in range(1000)}) == 1000


def test_metadata_default_is_not_shared():
    a, b = Request.new("t", "p"), Request.new("t", "p")
    a.metadata["x"] = "y"
    assert b.metadata == {}


def test_request_record_round_trip_and_plain_symbols():
    req = Request.new("t", "p", priority=Priority.LOW, task_tier=TaskTier.REALTIME, trace_id="x")
    rec = req.to_record()
    assert type(rec["priority"]) is str and rec["priority"] == "LOW"
    assert type(rec["task_tier"]) is str and rec["task_tier"] == "REALTIME"
    assert list(rec) == [f.name for f in dataclasses.fields(Request)]
    assert Request.from_record(rec) == req


def test_request_from_record_fills_absent_optional_fields():
    rec = Request.new("t", "p", admitted_at=1, effective_priority=Priority.HIGH, degraded_from="m",
                      messages=[{"role": "user", "content": "p"}], temperature=1.0, top_p=0.5, stop=["x"],
                      user="u", stream=True, reply_to="llm.r", reply_partition=1).to_record()
    for name in ("user_tier", "task_tier", "allow_degrade", "notify_queued", "trace_id", "metadata",
                 "admitted_at", "effective_priority", "degraded_from", "messages", "temperature", "top_p", "stop",
                 "user", "stream", "reply_to", "reply_partition"):
        del rec[name]
    req = Request.from_record(rec)
    assert (req.user_tier, req.task_tier, req.notify_queued, req.trace_id, req.metadata) == (
        "standard",
        TaskTier.ASYNC,
        False,
        None,
        {},
    )
    assert (req.admitted_at, req.effective_priority, req.degraded_from) == (None, None, None)
    assert (req.messages, req.temperature, req.top_p, req.stop, req.user, req.stream, req.reply_to,
            req.reply_partition) == ([], None, None, [], None, False, None, None)


def test_request_gateway_fields_record_round_trip():
    req = Request.new("t", "p", admitted_at=123, effective_priority=Priority.CRITICAL, degraded_from="sim-large")
    rec = req.to_record()
    assert rec["effective_priority"] == "CRITICAL" and type(rec["effective_priority"]) is str
    assert (rec["admitted_at"], rec["degraded_from"]) == (123, "sim-large")
    back = Request.from_record(rec)
    assert back == req and back.effective_priority is Priority.CRITICAL


# -- Request: the OpenAI shape (revision 4) -----------------------------------------


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is Kafka?"},
                {"role": "assistant", "content": "A log.\nA distributed one."}, {"role": "user", "content": "And?"}]


def test_request_new_from_messages_renders_the_prompt():
    req = Request.new("t", messages=CONVERSATION, temperature=0.3, top_p=0.9, stop=["\n\n"], user="u-1",
                      stream=True, reply_to="llm.replies.gw", reply_partition=4)
    assert req.prompt == ("system: Be brief.\nuser: What is Kafka?\nassistant: A log.\nA distributed one.\n"
                          "user: And?")
    assert req.prompt == render_conversation(CONVERSATION)
    assert req.messages == CONVERSATION and req.messages is not CONVERSATION
    assert (req.temperature, req.top_p, req.stop, req.user, req.stream, req.reply_to, req.reply_partition) == (
        0.3, 0.9, ["\n\n"], "u-1", True, "llm.replies.gw", 4)


def test_request_new_keeps_a_prompt_given_with_messages():
    assert Request.new("t", "summary of it", messages=CONVERSATION).prompt == "summary of it"


def test_request_new_needs_a_prompt_or_messages():
    for empty in ({}, {"messages": []}):
        with pytest.raises(ValueError, match="prompt or messages"):
            Request.new("t", **empty)
    assert Request.new("t", "").prompt == ""  # an empty prompt is validation's to refuse


def test_request_new_keeps_a_name_only_when_set():
    req = Request.new("t", messages=[{"role": "user", "content": "hi", "name": None},
                                     {"role": "user", "content": "yo", "name": "bob"}])
    assert req.messages == [{"role": "user", "content": "hi"}, {"role": "user", "content": "yo", "name": "bob"}]


@pytest.mark.parametrize("messages, fragment", [
    (["hello"], "messages[0]: a message is a mapping"),
    ([{"role": "user", "content": "a"}, {"role": "user"}], "messages[1]: missing content"),
    ([{"content": "a"}], "messages[0]: missing role"),
    ([{"role": "tool", "content": "a", "tool_call_id": "c1"}], "unknown keys ['tool_call_id']"),
])
def test_request_new_refuses_what_is_not_a_chat_message(messages, fragment):
    with pytest.raises(ValueError) as info:
        Request.new("t", messages=messages)
    assert fragment in str(info.value)


def test_request_new_takes_one_stop_string_as_openai_does():
    assert Request.new("t", "p", stop="END").stop == ["END"]
    assert Request.new("t", "p").stop == []


def test_chat_messages():
    plain = Request.new("t", "hello there")
    assert plain.chat_messages() == [{"role": "user", "content": "hello there"}]
    chat = Request.new("t", messages=CONVERSATION)
    got = chat.chat_messages()
    assert got == CONVERSATION
    got[0]["content"] = "changed"  # copies: the request is untouched
    assert chat.messages[0]["content"] == "Be brief."


def test_request_openai_fields_record_round_trip():
    req = Request.new("t", messages=[{"role": "user", "content": "hi", "name": "al"}], temperature=0.0, stop=["a"],
                      stream=True, reply_to="llm.x", reply_partition=0)
    rec = req.to_record()
    assert rec["messages"] == [{"role": "user", "content": "hi", "name": "al"}]
    assert Request.from_record(rec) == req
    # fastavro hands back a null name as a key with None: it comes back without one.
    rec["messages"] = [{"role": "user", "content": "hi", "name": None}]
    assert Request.from_record(rec).messages == [{"role": "user", "content": "hi"}]


def test_mutable_defaults_are_not_shared():
    a, b = Request.new("t", "p"), Request.new("t", "p")
    a.messages.append({"role": "user", "content": "x"})
    a.stop.append("s")
    assert (b.messages, b.stop) == ([], [])


def test_request_from_record_errors():
    rec = Request.new("t", "p").to_record()
    with pytest.raises(ValueError, match="priority"):
        Request.from_record({**rec, "priority": "URGENT"})
    with pytest.raises(ValueError, match="task_tier"):
        Request.from_record({**rec, "task_tier": ["not", "hashable"]})
    with pytest.raises(ValueError, match="effective_priority"):
        Request.from_record({**rec, "effective_priority": "URGENT"})
    del rec["prompt"]
    with pytest.raises(KeyError):
        Request.from_record(rec)


# -- Response ------------------------------------------------------------------


def test_response_for_request_copies_request_fields():
    req = Request.new("tenant", "p", priority=Priority.HIGH, created_at=1000)
    before = now_ms()
    resp = Response.for_request(req, Status.COMPLETED, output="hi", completion_tokens=3)
    assert resp.request_id == req.request_id
    assert resp.tenant_id == "tenant"
    assert resp.requested_priority is Priority.HIGH
    assert resp.created_at == 1000
    assert before <= resp.finished_at <= now_ms()
    assert (resp.status, resp.output, resp.completion_tokens) == (Status.COMPLETED, "hi", 3)
    assert resp.latency_ms == resp.finished_at - 1000


def test_response_for_request_accepts_status_names_and_finished_at():
    req = Request.new("t", "p")
    resp = Response.for_request(req, "rejected", reason="rate_limited: slow down", finished_at=7)
    assert resp.status is Status.REJECTED
    assert resp.finished_at == 7


def test_response_is_keyword_only():
    with pytest.raises(TypeError):
        Response("id", "t", Status.FAILED)  # type: ignore[misc]


@pytest.mark.parametrize("served", [None, Priority.LOW])
def test_response_record_round_trip(served):
    req = Request.new("t", "p")
    resp = Response.for_request(
        req, Status.COMPLETED, served_priority=served, admitted_at=1, started_at=2, retry_after_ms=None
    )
    rec = resp.to_record()
    assert rec["status"] == "COMPLETED" and type(rec["status"]) is str
    assert type(rec["requested_priority"]) is str
    assert rec["served_priority"] == (None if served is None else "LOW")
    assert list(rec) == [f.name for f in dataclasses.fields(Response)]
    assert Response.from_record(rec) == resp


def test_queued_response_record_round_trip():
    resp = Response.for_request(Request.new("t", "p"), "queued", queue_position=4, eta_ms=2500)
    rec = resp.to_record()
    assert (rec["status"], rec["queue_position"], rec["eta_ms"]) == ("QUEUED", 4, 2500)
    back = Response.from_record(rec)
    assert back == resp and not back.status.is_terminal
    del rec["queue_position"], rec["eta_ms"]  # as a revision 1 record has it
    assert (Response.from_record(rec).queue_position, Response.from_record(rec).eta_ms) == (None, None)


def test_response_finish_reason_and_usage_estimated():
    resp = Response.for_request(Request.new("t", "p"), Status.COMPLETED, output="x", finish_reason="length",
                                usage_estimated=True)
    rec = resp.to_record()
    assert (rec["finish_reason"], rec["usage_estimated"]) == ("length", True)
    assert Response.from_record(rec) == resp
    del rec["finish_reason"], rec["usage_estimated"]  # as a revision 2 record has it
    back = Response.from_record(rec)
    assert (back.finish_reason, back.usage_estimated) == (None, False)
    plain = Response.for_request(Request.new("t", "p"), Status.FAILED)
    assert (plain.finish_reason, plain.usage_estimated) == (None, False)


def test_response_from_record_rejects_unknown_symbols():
    rec = Response.for_request(Request.new("t", "p"), Status.FAILED).to_record()
    for name in ("status", "requested_priority", "served_priority"):
        with pytest.raises(ValueError, match=name):
            Response.from_record({**rec, name: "NOPE"})


def test_now_ms_is_epoch_milliseconds():
    assert abs(now_ms() - time.time() * 1000) < 1000
