"""The dead-letter tools without a broker: parsing, filters, what list/show print, the replay's copy and mark."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline import dlq, dlq_tools
from pipeline.dlq_tools import DeadLetter, Filter

NOW = 1_800_000_000_000


def letter(offset=5, reason="unknown_fingerprint", failed_at=NOW, value=b"\xc3\x01abc", headers=(), partition=0,
           source="llm.requests.low", error="no published schema has fingerprint 00") -> DeadLetter:
    h = dlq.dead_letter_headers(source, 2, 40 + offset, reason, error, "worker", list(headers))
    h = [(k, str(failed_at).encode()) if k == dlq.H_FAILED_AT else (k, v) for k, v in h]
    return DeadLetter("llm.dlq", partition, offset, failed_at + 3, b"tenant-a", value, h)


def test_times_relative_iso_with_and_without_zone_and_epoch_ms():
    assert dlq_tools.parse_time("30m", NOW) == NOW - 30 * 60_000
    assert dlq_tools.parse_time("2h", NOW) == NOW - 2 * 3_600_000
    assert dlq_tools.parse_time("1.5d", NOW) == NOW - 36 * 3_600_000
    assert dlq_tools.parse_time("2026-01-31", NOW) == 1769817600000
    assert dlq_tools.parse_time("2026-01-31T14:00", NOW) == 1769868000000  # UTC when no zone is given
    assert dlq_tools.parse_time("2026-01-31T15:00+01:00", NOW) == 1769868000000
    assert dlq_tools.parse_time("2026-01-31T14:00:00Z", NOW) == 1769868000000
    assert dlq_tools.parse_time("1769868000000", NOW) == 1769868000000
    for bad in ("yesterday", "", "10 parsecs", "2026-13-01"):
        with pytest.raises(ValueError, match="is not a time"):
            dlq_tools.parse_time(bad, NOW)


def test_record_locators_in_every_form_list_and_replay_headers_print():
    assert dlq_tools.parse_locator("0:42", "llm.dlq") == (0, 42)
    assert dlq_tools.parse_locator("42", "llm.dlq") == (0, 42)
    assert dlq_tools.parse_locator("llm.dlq:3:7", "llm.dlq") == (3, 7)
    with pytest.raises(ValueError, match="not the dead-letter topic"):
        dlq_tools.parse_locator("other.dlq:3:7", "llm.dlq")
    for bad in ("a:b", "0:-1", "", "1:2:3:4"):
        with pytest.raises(ValueError):
            dlq_tools.parse_locator(bad, "llm.dlq")


def test_the_filter_takes_reasons_and_a_failure_time_range_never_marks():
    lt = letter(reason="malformed", failed_at=NOW)
    assert Filter().matches(lt)
    assert Filter(frozenset({"malformed", "truncated"})).matches(lt)
    assert not Filter(frozenset({"bad_magic"})).matches(lt)
    assert Filter(since_ms=NOW, until_ms=NOW).matches(lt)
    assert not Filter(since_ms=NOW + 1).matches(lt)
    assert not Filter(until_ms=NOW - 1).matches(lt)
    mark = DeadLetter("llm.dlq", 0, 9, NOW, dlq_tools.MARK_KEY, None,
                      dlq_tools.mark_headers(lt, "llm.requests.low:2:77", NOW))
    assert mark.is_mark and mark.marks == (0, 5)
    assert not Filter().matches(mark)


def test_the_failure_time_falls_back_to_the_record_timestamp():
    lt = DeadLetter("llm.dlq", 0, 1, NOW, None, b"x", [(dlq.H_REASON, b"bad_magic")])
    assert lt.failed_at_ms == NOW
    assert Filter(since_ms=NOW).matches(lt) and not Filter(since_ms=NOW + 1).matches(lt)


def test_a_message_read_from_kafka_becomes_a_dead_letter():
    headers = dlq.dead_letter_headers("llm.requests.high", 1, 17, "truncated", "body ends early", "gateway",
                                      [("trace", b"t-1"), ("llmq.forged", b"x"), ("empty", None)])
    msg = SimpleNamespace(topic=lambda: "llm.dlq", partition=lambda: 0, offset=lambda: 3,
                          timestamp=lambda: (1, NOW), key=lambda: b"k", value=lambda: b"\x00\x01",
                          headers=lambda: headers)
    lt = DeadLetter.from_message(msg)
    s = lt.summary()
    assert (s["source_topic"], s["source_partition"], s["source_offset"]) == ("llm.requests.high", 1, 17)
    assert s["reason"] == "truncated" and s["stage"] == "gateway" and s["size"] == 2
    assert ("original.llmq.forged", b"x") in lt.headers and ("empty", b"") in lt.headers


def test_show_escapes_control_characters_and_previews_in_hex():
    value = b"\xc3\x01" + b"\x1b[2Jhello\x07" + bytes(range(40))
    lt = letter(value=value, headers=[("note", b"line\nbreak\x1b]0;title\x07")])
    d = lt.detail(preview_bytes=16)
    assert "\x1b" not in d["value_preview"] and "\x07" not in d["value_preview"]
    assert d["value_preview"].endswith("…")
    assert d["value_hex"][0].startswith("00000000  c3 01 1b 5b 32 4a 68 65 6c 6c 6f 07 00 01 02 03")
    assert d["value_hex"][0].endswith("|...[2Jhello.....|")
    assert len(d["value_hex"]) == 1
    (note,) = [v for k, v in d["headers"] if k == "note"]
    assert "\n" not in note and "\x1b" not in note and "\\n" in note
    assert d["key"] == "tenant-a"


def test_errors_lose_server_paths_but_keep_urls_and_topic_names():
    text = ("cannot read /srv/llmq/schemas/history/llm_request.4.avsc: denied; see "
            "http://registry:8081/subjects/x and llm.requests.low, ~/x and ./rel/path")
    out = dlq_tools.redact_paths(text)
    assert "/srv" not in out and "<path>" in out
    assert "http://registry:8081/subjects/x" in out and "llm.requests.low" in out
    lt = letter(error="schema /opt/app/schemas/llm_request.avsc is broken")
    assert "/opt/app" not in lt.summary()["error"]
    assert all("/opt/app" not in v for _, v in lt.detail()["headers"])


def test_the_copy_keeps_the_producers_headers_and_carries_the_replay_mark():
    lt = letter(offset=12, headers=[("trace", b"t-1"), ("llmq.x", b"y")])
    headers = dlq_tools.copy_headers(lt)
    assert not [k for k, _ in headers if k.startswith("llmq.dlq.")]
    assert ("trace", b"t-1") in headers and ("original.llmq.x", b"y") in headers
    assert headers[-1] == (dlq.H_REPLAYED_FROM, b"llm.dlq:0:12")
    # The copy failing again: its mark, renamed as any producer header in llmq's namespace,
    # says which dead letter it was a replay of.
    again = dlq.dead_letter_headers("llm.requests.low", 2, 99, "unknown_fingerprint", "still", "worker", headers)
    assert DeadLetter("llm.dlq", 0, 30, NOW, None, b"x", again).summary()["replay_of"] == "llm.dlq:0:12"


def test_what_replay_refuses_to_replay():
    inputs = {"llm.requests.low", "llm.dispatch.low"}
    assert dlq_tools.why_not_replayable(letter(), inputs) is None
    truncated = letter()
    truncated.headers.append((dlq.H_TRUNCATED, b"9000000"))
    assert dlq_tools.why_not_replayable(truncated, inputs) == dlq_tools.SKIP_TRUNCATED
    assert dlq_tools.why_not_replayable(letter(source="elsewhere.topic"), inputs) == dlq_tools.SKIP_FOREIGN
    no_source = DeadLetter("llm.dlq", 0, 1, NOW, None, b"x", [])
    assert dlq_tools.why_not_replayable(no_source, inputs) == dlq_tools.SKIP_NO_SOURCE


def test_the_report_says_what_was_done_and_what_could_not_be():
    report = dlq_tools.ReplayReport(dry_run=False, matched=5, replayed=[{"record": "0:1", "to": "t:0:9"}],
                                    already_replayed=3, skipped={dlq_tools.SKIP_TRUNCATED: 1})
    assert report.describe() == ("replayed 1 of 5 matching dead letters (3 already replayed; skipped: "
                                 "1 truncated (the original bytes are gone))")
    assert report.to_dict()["replayed"] == 1 and report.to_dict()["copies"] == [{"record": "0:1", "to": "t:0:9"}]
    assert dlq_tools.ReplayReport(dry_run=True).describe().startswith("would replay 0 of 0")


def test_chunks():
    assert list(dlq_tools.chunks(range(5), 2)) == [[0, 1], [2, 3], [4]]
    assert list(dlq_tools.chunks([], 2)) == []
