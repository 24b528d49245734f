"""The dead-letter record as the hot path writes it: its headers, and reading them back."""

from __future__ import annotations

import ast
import time
from pathlib import Path

from pipeline import dlq

PIPELINE = Path(dlq.__file__).parent


def test_the_headers_say_where_the_message_was_why_and_when_before_the_producers_own():
    before = int(time.time() * 1000)
    headers = dlq.dead_letter_headers("llm.requests.high", 1, 17, "truncated", "body ends early", "gateway",
                                      [("trace", b"t-1")])
    after = int(time.time() * 1000)
    names = [k for k, _ in headers]
    assert names == [dlq.H_SOURCE_TOPIC, dlq.H_SOURCE_PARTITION, dlq.H_SOURCE_OFFSET, dlq.H_REASON, dlq.H_ERROR,
                     dlq.H_STAGE, dlq.H_FAILED_AT, "trace"]
    h = dict(headers)
    assert (h[dlq.H_SOURCE_TOPIC], h[dlq.H_SOURCE_PARTITION], h[dlq.H_SOURCE_OFFSET]) == (
        b"llm.requests.high", b"1", b"17")
    assert (h[dlq.H_REASON], h[dlq.H_ERROR], h[dlq.H_STAGE]) == (b"truncated", b"body ends early", b"gateway")
    assert before <= int(h[dlq.H_FAILED_AT]) <= after
    assert h["trace"] == b"t-1"
    assert dlq.dead_letter_headers("t", 0, 0, "r", "e", "worker")[-1][0] == dlq.H_FAILED_AT


def test_a_producer_cannot_forge_llmqs_headers_and_the_error_is_cut():
    forged = [(dlq.H_REASON, b"none"), (dlq.H_SOURCE_TOPIC, b"elsewhere"), (dlq.H_REPLAYED_FROM, b"llm.dlq:0:1"),
              ("empty", None)]
    headers = dlq.dead_letter_headers("llm.requests.low", 0, 3, "bad_magic", "x" * 5000, "worker", forged)
    assert [v for k, v in headers if k == dlq.H_REASON] == [b"bad_magic"]
    assert [v for k, v in headers if k == dlq.H_SOURCE_TOPIC] == [b"llm.requests.low"]
    assert ("original." + dlq.H_REASON, b"none") in headers
    assert (dlq.H_ORIGINAL_REPLAYED_FROM, b"llm.dlq:0:1") in headers
    assert ("empty", b"") in headers
    assert len(dict(headers)[dlq.H_ERROR]) == 1000
    assert dlq.header_dict(headers)[dlq.H_REASON] == "bad_magic"


def test_header_dict_reads_back_only_llmqs_dead_letter_headers():
    headers = dlq.dead_letter_headers("llm.requests.low", 2, 9, "malformed", "bad \udcff byte", "worker",
                                      [("trace", b"t-1"), ("llmq.dlq.reason", b"spoofed")])
    h = dlq.header_dict(headers + [(dlq.H_TRUNCATED, None)])
    assert set(h) == {dlq.H_SOURCE_TOPIC, dlq.H_SOURCE_PARTITION, dlq.H_SOURCE_OFFSET, dlq.H_REASON, dlq.H_ERROR,
                      dlq.H_STAGE, dlq.H_FAILED_AT, dlq.H_TRUNCATED}
    assert (h[dlq.H_REASON], h[dlq.H_SOURCE_OFFSET], h[dlq.H_TRUNCATED]) == ("malformed", "9", "")
    assert h[dlq.H_ERROR] == "bad ? byte"
    assert dlq.header_dict(None) == {}


def _pipeline_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("pipeline")}


def test_the_hot_path_imports_nothing_of_the_operator_tools():
    assert _pipeline_imports(PIPELINE / "dlq.py") == set()
    hot = [p for d in ("worker", "gateway", "serve") for p in sorted((PIPELINE / d).rglob("*.py"))]
    assert hot
    assert [str(p) for p in hot if any(m.startswith("pipeline.dlq_tools") for m in _pipeline_imports(p))] == []
