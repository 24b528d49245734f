import pytest

from pipeline.models import Request
from pipeline.policy.validation import validate_request


def test_a_well_formed_request_passes():
    assert validate_request(Request.new("tenant-a", "hello")) is None


@pytest.mark.parametrize("change, fragment", [
    ({"tenant_id": ""}, "tenant_id is empty"),
    ({"tenant_id": "   "}, "tenant_id is empty"),
    ({"tenant_id": "evil\x00tenant"}, "control characters"),
    ({"tenant_id": "t\nx"}, "control characters"),
    ({"tenant_id": "x" * 300}, "longer than"),
    ({"prompt": ""}, "prompt is empty"),
    ({"max_tokens": 0}, "max_tokens must be > 0"),
    ({"max_tokens": -5}, "max_tokens must be > 0"),
    ({"max_tokens": 10**7}, "max_tokens must be <="),
    ({"timeout_ms": -1}, "timeout_ms must be > 0"),
    ({"request_id": "not-a-uuid"}, "request_id must be a UUID"),
    ({"request_id": "zzzzzzzz-zzzz-zzzz-zzzz-zzzzzzzzzzzz"}, "request_id must be a UUID"),
])
def test_invalid_requests_get_a_precise_reason(change, fragment):
    req = Request.new("tenant-a", "hello")
    for k, v in change.items():
        setattr(req, k, v)
    reason = validate_request(req)
    assert reason is not None and reason.startswith("invalid_request: ")
    assert fragment in reason


@pytest.mark.parametrize("tenant", ["tenant\u202egnp.exe", "zero\u200bwidth", "line\u2028sep", "\ufeffbom"])
def test_tenant_ids_with_invisible_or_reordering_characters_are_refused(tenant):
    req = Request.new("x", "hello")
    req.tenant_id = tenant
    assert "control characters" in validate_request(req)


def test_trace_ids_are_short_printable_tokens():
    req = Request.new("tenant-a", "hello", trace_id="4bf92f3577b34da6a3ce929d0e0e4736")
    assert validate_request(req) is None
    req.trace_id = "trace\x1b[2J\n"
    assert validate_request(req).startswith("invalid_request: trace_id")
    req.trace_id = "t" * 129
    assert validate_request(req).startswith("invalid_request: trace_id")


def test_requests_dated_in_the_future_beyond_clock_skew_are_refused():
    req = Request.new("tenant-a", "hello")
    now = req.created_at
    assert validate_request(req, now_ms=now) is None
    req.created_at = now + 60_000  # a minute of skew is tolerated
    assert validate_request(req, now_ms=now) is None
    req.created_at = now + 3_600_000
    assert "in the future" in validate_request(req, now_ms=now)


# -- revision 4: the OpenAI request shape -----------------------------------------------------------

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi", "name": "alice_1"}]


def _chat_request(**fields) -> Request:
    return Request.new("tenant-a", messages=fields.pop("messages", CHAT), **fields)


def test_a_well_formed_chat_request_passes():
    req = _chat_request(temperature=0.7, top_p=1.0, stop=["\n\n", "END"], user="end-user-7", stream=True,
                        reply_to="llm.replies.gw-1", reply_partition=0)
    assert validate_request(req) is None
    assert validate_request(req, req.created_at, topics_prefix="llm") is None
    assert validate_request(req, now_ms=req.created_at) is None  # the positional call shape, too


@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool", "developer"])
def test_every_openai_role_is_valid(role):
    assert validate_request(_chat_request(messages=[{"role": role, "content": "x"}])) is None


def _reason(req: Request, **kwargs) -> str:
    reason = validate_request(req, **kwargs)
    assert reason is not None and reason.startswith("invalid_request: "), reason
    return reason


@pytest.mark.parametrize("messages, fragment", [
    ([{"role": "User", "content": "x"}], "messages[0].role must be one of system, user, assistant, tool, developer"),
    ([{"role": "user", "content": "x"}, {"role": "function", "content": "x"}], "messages[1].role must be one of"),
    ([{"role": "", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x", "name": "has space"}], "messages[0].name must be 1-64 characters"),
    ([{"role": "user", "content": "x", "name": "n" * 65}], "messages[0].name"),
    ([{"role": "user", "content": "x", "name": "evil\x1b[2J"}], "messages[0].name"),
    ([{"role": "user", "content": "x", "name": ""}], "messages[0].name"),
    ([{"role": "user", "content": "c" * 262_145}], "messages[0].content is longer than 262144 characters"),
    ([{"role": "user", "content": "c" * 131_073}] * 2, "messages hold 262146 characters of content, more than 262144"),
    ([{"role": "user", "content": "x"}] * 257, "messages has 257 entries, more than 256"),
])
def test_invalid_messages_get_a_reason_naming_the_field(messages, fragment):
    req = Request.new("tenant-a", "prompt")
    req.messages = messages
    assert fragment in _reason(req)


def test_messages_as_built_by_hand_are_checked_too():
    req = Request.new("tenant-a", "prompt")
    req.messages = ["not a message"]
    assert "messages[0] is not a message" in _reason(req)
    req.messages = [{"role": "user", "content": 7}]
    assert "messages[0].content must be a string" in _reason(req)


def test_messages_at_the_limits_pass():
    at_count = [{"role": "user", "content": "x"}] * 256
    assert validate_request(_chat_request(messages=at_count)) is None
    at_size = [{"role": "user", "content": "c" * 131_072}] * 2
    req = Request.new("tenant-a", "p", messages=at_size)
    assert validate_request(req) is None
    assert validate_request(_chat_request(messages=[{"role": "user", "content": ""}])) is None  # may be empty


def test_a_role_is_never_quoted_back():
    req = Request.new("tenant-a", "p")
    req.messages = [{"role": "\x1b]0;owned\x07", "content": "x"}]
    assert "\x1b" not in _reason(req) and "owned" not in _reason(req)


@pytest.mark.parametrize("value, ok", [
    (0, True), (0.0, True), (1, True), (2.0, True), (0.7, True),
    (-0.01, False), (2.0001, False), (float("nan"), False), (float("inf"), False), (True, False), ("1", False),
])
def test_temperature_is_from_0_to_2(value, ok):
    req = Request.new("tenant-a", "p")
    req.temperature = value
    if ok:
        assert validate_request(req) is None
    else:
        assert "temperature must be a number from 0 to 2" in _reason(req)


@pytest.mark.parametrize("value, ok", [
    (1, True), (1.0, True), (0.5, True), (1e-9, True),
    (0, False), (0.0, False), (-0.5, False), (1.0001, False), (float("nan"), False), (False, False),
])
def test_top_p_is_above_0_and_at_most_1(value, ok):
    req = Request.new("tenant-a", "p")
    req.top_p = value
    if ok:
        assert validate_request(req) is None
    else:
        assert "top_p must be a number above 0, at most 1" in _reason(req)


@pytest.mark.parametrize("stop, fragment", [
    (["a", "b", "c", "d", "e"], "stop has 5 sequences, more than 4"),
    (["s" * 65], "stop[0] must be a string of 1-64 characters"),
    (["ok", ""], "stop[1] must be a string of 1-64 characters"),
    (["ok", 3], "stop[1]"),
])
def test_invalid_stop_sequences(stop, fragment):
    req = Request.new("tenant-a", "p")
    req.stop = stop
    assert fragment in _reason(req)


def test_stop_sequences_at_the_limits_pass():
    assert validate_request(Request.new("tenant-a", "p", stop=["s" * 64, "\n", "é" * 64, "END"])) is None


@pytest.mark.parametrize("user, ok", [
    ("end-user-7", True), ("u" * 256, True), ("user@example.com", True),
    ("", False), ("u" * 257, False), ("evil\nX-Admin: 1", False), ("bidi\u202e", False), (7, False),
])
def test_user_is_a_short_printable_id(user, ok):
    req = Request.new("tenant-a", "p")
    req.user = user
    if ok:
        assert validate_request(req) is None
    else:
        assert "user must be 1-256 characters without control characters" in _reason(req)


@pytest.mark.parametrize("partition, ok", [(0, True), (5, True), (2**31 - 1, True), (-1, False), (True, False),
                                           (1.0, False)])
def test_reply_partition_is_at_least_0(partition, ok):
    req = Request.new("tenant-a", "p", reply_to="llm.replies.gw-1")
    req.reply_partition = partition
    if ok:
        assert validate_request(req, topics_prefix="llm") is None
    else:
        assert "reply_partition must be >= 0" in _reason(req)


def test_reply_partition_without_reply_to_is_a_partition_of_the_default_topic():
    assert validate_request(Request.new("tenant-a", "p", reply_partition=3), topics_prefix="llm") is None


@pytest.mark.parametrize("topic", ["bad topic", "llm/replies", "llm.replies:1", "", ".", "..", "t" * 250, "llm.é",
                                   "llm.replies\n"])
def test_reply_to_must_be_a_kafka_topic_name(topic):
    req = Request.new("tenant-a", "p", reply_to=topic)
    for prefix in (None, "llm"):
        assert "reply_to must be a Kafka topic name" in _reason(req, topics_prefix=prefix)


def test_reply_to_of_the_longest_legal_name_passes():
    name = "llm." + "r" * 245
    assert len(name) == 249
    assert validate_request(Request.new("tenant-a", "p", reply_to=name), topics_prefix="llm") is None


@pytest.mark.parametrize("topic", ["other.replies", "llmq.replies", "llm", "replies.llm.x", "LLM.replies"])
def test_reply_to_must_be_under_the_configured_prefix(topic):
    req = Request.new("tenant-a", "p", reply_to=topic)
    assert "reply_to must be a topic under the pipeline's prefix (llm.*)" in _reason(req, topics_prefix="llm")
    assert validate_request(req) is None  # no prefix given: the check is skipped


@pytest.mark.parametrize("topic", ["llm.requests.critical", "llm.requests.background", "llm.dispatch.normal",
                                   "llm.dlq", "llm.cancellations", "llm.chunks"])
def test_reply_to_must_not_name_the_pipelines_own_topics(topic):
    # An answer written there would be read as a request, a dead letter or a cancellation.
    req = Request.new("tenant-a", "p", reply_to=topic)
    assert "reply_to names one of the pipeline's own" in _reason(req, topics_prefix="llm")


def test_reply_to_follows_the_configured_prefix():
    req = Request.new("tenant-a", "p", reply_to="staging.llm.replies.gw-2")
    assert validate_request(req, topics_prefix="staging.llm") is None
    assert "under the pipeline's prefix" in _reason(req, topics_prefix="llm")
    own = Request.new("tenant-a", "p", reply_to="staging.llm.dlq")
    assert "own" in _reason(own, topics_prefix="staging.llm")
    assert validate_request(Request.new("tenant-a", "p", reply_to="llm.responses"), topics_prefix="llm") is None


def test_reply_to_is_never_quoted_back():
    req = Request.new("tenant-a", "p", reply_to="evil\x1b[2J topic")
    assert "evil" not in _reason(req, topics_prefix="llm")


def test_stream_needs_no_check():
    assert validate_request(Request.new("tenant-a", "p", stream=True)) is None


def test_older_checks_come_first():
    req = _chat_request(temperature=5.0)
    req.tenant_id = ""
    assert "tenant_id is empty" in _reason(req)
