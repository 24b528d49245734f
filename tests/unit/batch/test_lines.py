import json

from pipeline.batch.lines import error_line, line_request_id, output_line, parse_lines, retryable
from pipeline.models import Request, Response, Status

EP = "/v1/chat/completions"


def _doc(i, **over):
    doc = {"custom_id": f"c{i}", "method": "POST", "url": EP,
           "body": {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 5}}
    doc.update(over)
    return json.dumps(doc).encode()


def test_good_and_bad_lines_are_told_apart_with_reasons():
    data = b"\n".join([_doc(0), b"{oops", _doc(2, url="/v1/completions"), b"", _doc(3, custom_id="c0"),
                       _doc(4, body={"model": "m", "messages": []}), _doc(5, method="GET"), _doc(6)])
    lines = parse_lines(data, EP, 16)
    assert [line.index for line in lines] == list(range(7))  # blank lines are skipped
    ok = [line.custom_id for line in lines if line.error is None]
    assert ok == ["c0", "c6"]
    errors = {line.custom_id: line.error for line in lines if line.error}
    assert "JSON" in errors["line-2"]
    assert "url" in errors["c2"] and "repeats" in errors["c0"] or "repeats" in str(errors)
    assert "messages" in errors["c4"] and "POST" in errors["c5"]
    assert lines[0].parsed.fields["max_tokens"] == 5


def test_a_stream_line_is_refused_and_a_missing_max_tokens_gets_the_default():
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    lines = parse_lines(_doc(0, body=body | {"stream": True}) + b"\n" + _doc(1, body=body), EP, 16)
    assert "stream" in lines[0].error and lines[1].parsed.fields["max_tokens"] == 16


def test_request_ids_are_fixed_by_batch_line_and_attempt():
    a = line_request_id("batch_1", 3, 0)
    assert a == line_request_id("batch_1", 3, 0)
    assert len({a, line_request_id("batch_1", 3, 1), line_request_id("batch_1", 4, 0),
                line_request_id("batch_2", 3, 0)}) == 4


def test_which_answers_mean_later():
    req = Request.new("t", "p")
    assert retryable(Response.for_request(req, Status.REJECTED, reason="queue_full: band NORMAL"), True)
    assert retryable(Response.for_request(req, Status.REJECTED, reason="rate_limited: x"), False)
    assert not retryable(Response.for_request(req, Status.REJECTED, reason="invalid_request: x"), True)
    assert retryable(Response.for_request(req, Status.EXPIRED), True)
    assert not retryable(Response.for_request(req, Status.EXPIRED), False)
    assert not retryable(Response.for_request(req, Status.FAILED, reason="backend_error"), True)


def test_output_and_error_lines_have_openai_shapes():
    line = parse_lines(_doc(7), EP, 16)[0]
    req = Request.new("t", "p", request_id=line_request_id("b", 0, 0))
    done = output_line(line, Response.for_request(req, Status.COMPLETED, output="hi", finished_at=1000), EP)
    assert done["custom_id"] == "c7" and done["response"]["status_code"] == 200 and done["error"] is None
    assert done["response"]["body"]["choices"][0]["message"]["content"] == "hi"
    refused = output_line(line, Response.for_request(req, Status.REJECTED, reason="forbidden: no"), EP)
    assert refused["response"]["status_code"] == 403 and refused["response"]["body"]["error"]["message"]
    expired = error_line(line, req.request_id, "batch_expired", "too late")
    assert expired["response"] is None and expired["error"]["code"] == "batch_expired"
