"""A request over a size cap: still read, when it safely can be, so that it is answered, not dead-lettered."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from pipeline.errors import DecodeError, LimitExceeded
from pipeline.models import Priority, Request
from pipeline.openai_api.errors import for_reason
from pipeline.serde import SINGLE_OBJECT_MAGIC, Codec, SchemaStore, SerdeLimits
from pipeline.serde.fingerprint import schema_fingerprint
from pipeline.testing import avro_string
from tests.unit.serde import SCHEMAS_DIR, avro_body, full_request, history_schema, zigzag


@pytest.fixture(scope="module")
def tight() -> tuple[Codec, Codec]:
    """(lenient encoder, strict decoder) so over-cap messages can be produced."""
    store = SchemaStore.load(SCHEMAS_DIR)
    lenient = Codec(store, SerdeLimits(max_prompt_bytes=10**6, max_string_bytes=10**6, max_metadata_entries=10**6,
                                       max_messages=10**6, max_array_items=10**6))
    strict = Codec(store, SerdeLimits(max_prompt_bytes=100, max_string_bytes=40, max_metadata_entries=3,
                                      max_messages=3, max_array_items=2))
    return lenient, strict


def _over_limit(codec: Codec, data: bytes) -> LimitExceeded:
    with pytest.raises(LimitExceeded) as info:
        codec.decode_request(data)
    assert info.value.reason == "limit_exceeded"
    return info.value


def test_a_900kb_prompt_is_refused_yet_says_who_sent_it_and_where_the_answer_goes():
    codec = Codec.default()
    big = Codec(codec.store, SerdeLimits(max_prompt_bytes=10**6))
    req = Request.new("acme", "p" * 900_000, priority=Priority.HIGH, reply_to="llm.replies.gw-1", reply_partition=2,
                      trace_id="trace-1")
    exc = _over_limit(codec, big.encode_request(req))
    assert exc.detail == "LLMRequest.prompt: 900000 bytes exceed max_prompt_bytes=262144"  # what a dead letter says
    assert exc.request == req
    assert exc.refusal == "invalid_request: prompt is 900000 bytes, over the 262144-byte limit (max_prompt_bytes)"
    error = for_reason(exc.refusal)  # what llmq serve makes of the answer
    assert (error.status, error.type, error.code) == (400, "invalid_request_error", "invalid_request")


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        ({"prompt": "€" * 34}, "prompt is 102 bytes, over the 100-byte limit (max_prompt_bytes)"),
        ({"messages": [{"role": "user", "content": "c" * 101}]},
         "messages[].content is 101 bytes, over the 100-byte limit (max_prompt_bytes)"),
        ({"messages": [{"role": "r" * 41, "content": "c"}]},
         "messages[].role is 41 bytes, over the 40-byte limit (max_string_bytes)"),
        ({"model": "m" * 41}, "model is 41 bytes, over the 40-byte limit (max_string_bytes)"),
        ({"user": "u" * 41}, "user is 41 bytes, over the 40-byte limit (max_string_bytes)"),
        ({"stop": ["s" * 41]}, "stop[] is 41 bytes, over the 40-byte limit (max_string_bytes)"),
        # The sender's text (a map key) is never quoted back.
        ({"metadata": {"secret-key": "v" * 41}},
         "metadata value is 41 bytes, over the 40-byte limit (max_string_bytes)"),
        ({"metadata": {"k" * 41: "v"}}, "metadata key is 41 bytes, over the 40-byte limit (max_string_bytes)"),
        # Several fields over: the first one named.
        ({"prompt": "x" * 101, "model": "m" * 41}, "prompt is 101 bytes, over the 100-byte limit (max_prompt_bytes)"),
    ],
)
def test_any_string_over_its_cap_still_reads(tight, overrides, refusal):
    lenient, strict = tight
    req = full_request(**overrides)
    exc = _over_limit(strict, lenient.encode_request(req))
    assert exc.request == req
    assert exc.refusal == "invalid_request: " + refusal
    assert "secret-key" not in exc.refusal


def test_an_older_writers_request_over_a_cap_still_reads(tight):
    _, strict = tight
    rev1 = history_schema("llm_request", 1)
    record = full_request(prompt="x" * 101).to_record()
    data = SINGLE_OBJECT_MAGIC + schema_fingerprint(rev1).le_bytes + avro_body(rev1, record)
    exc = _over_limit(strict, data)
    assert exc.request.request_id == record["request_id"] and exc.request.reply_to is None


@pytest.mark.parametrize("field", ["request_id", "tenant_id", "reply_to", "trace_id"])
def test_no_request_when_what_its_answer_carries_is_over_its_cap(tight, field):
    # The answer echoes these (or goes where they say): it could not be encoded or routed.
    lenient, strict = tight
    exc = _over_limit(strict, lenient.encode_request(full_request(**{field: "é" * 21, "prompt": "x" * 101})))
    assert exc.request is None


def _with_stop(data: bytes, stop: bytes) -> bytes:
    encoded = zigzag(2) + avro_string("\n\n") + avro_string("END") + zigzag(0)  # full_request's stop
    assert data.count(encoded) == 1
    return data.replace(encoded, stop)


def test_item_and_entry_caps_still_refuse_reading(tight):
    lenient, strict = tight
    for over in (dict(stop=["a", "b", "c"]), dict(messages=[{"role": "user", "content": "c"}] * 4),
                 dict(metadata={f"k{i}": "v" for i in range(4)})):
        exc = _over_limit(strict, lenient.encode_request(full_request(**over)))
        assert exc.unit in ("items", "entries") and exc.request is None
        # Behind a prompt over its cap as well: the lifted read keeps those caps.
        exc = _over_limit(strict, lenient.encode_request(full_request(prompt="x" * 101, **over)))
        assert exc.unit == "bytes" and exc.request is None


def test_an_array_block_count_bomb_behind_an_over_cap_prompt_is_refused_fast_in_little_memory(tight):
    lenient, strict = tight
    big = lenient.encode_request(full_request(prompt="x" * 101))
    for bomb in (zigzag(1 << 62), zigzag(-(1 << 62)) + zigzag(1 << 62), zigzag(100) + b"\x02s" * 100 + b"\x00"):
        data = _with_stop(big, bomb)
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            exc = _over_limit(strict, data)
            elapsed = time.perf_counter() - t0
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert exc.field == "LLMRequest.prompt" and exc.request is None
        assert elapsed < 0.1 and peak < 1_000_000


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda data: b"\xde\xad" + data[2:], "bad_magic"),
        (lambda data: data[:len(data) // 2], "truncated"),
        (lambda data: data + b"\x00garbage", "malformed"),
    ],
    ids=["wrong magic", "cut short", "trailing bytes"],
)
def test_bytes_that_do_not_decode_are_no_request(tight, make, reason):
    lenient, strict = tight
    data = make(lenient.encode_request(full_request(prompt="x" * 10)))
    with pytest.raises(DecodeError) as info:
        strict.decode_request(data)
    assert info.value.reason == reason and not isinstance(info.value, LimitExceeded)


def test_an_over_cap_prompt_in_bytes_that_do_not_decode_is_no_request(tight):
    lenient, strict = tight
    data = lenient.encode_request(full_request(prompt="x" * 101))
    for broken in (data + b"\x00garbage", data.replace(b"x" * 101, b"x" * 100 + b"\xff")):
        assert _over_limit(strict, broken).request is None


def test_over_max_record_bytes_nothing_is_read():
    codec = Codec.default()
    big = Codec(codec.store, SerdeLimits(max_record_bytes=2 * 10**6, max_prompt_bytes=2 * 10**6))
    with pytest.raises(DecodeError) as info:
        codec.decode_request(big.encode_request(Request.new("acme", "p" * 1_100_000)))
    assert info.value.reason == "too_large" and not isinstance(info.value, LimitExceeded)
