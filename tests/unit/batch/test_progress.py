from pipeline.batch.lines import parse_lines
from pipeline.batch.progress import BatchProgress, Verdict
from pipeline.models import Request, Response, Status

EP = "/v1/completions"


def _progress(n=5, bad=(), outstanding=100, window_end=10_000_000):
    rows = []
    for i in range(n):
        rows.append(b"{bad" if i in bad else
                    b'{"custom_id":"c%d","method":"POST","url":"/v1/completions","body":{"model":"m","prompt":"p"}}' % i)
    return BatchProgress("batch_x", parse_lines(b"\n".join(rows), EP, 8), window_end, outstanding)


def _answer(p, index, status, reason=None, retry_after_ms=None):
    req = Request.new("t", "p", request_id=p.request_id(index))
    return Response.for_request(req, status, reason=reason, retry_after_ms=retry_after_ms)


def test_every_line_answered_once_whatever_repeats():
    p = _progress(4, bad=(2,))
    assert list(p.to_submit(0)) == [0, 1, 3]
    first = _answer(p, 0, Status.COMPLETED)
    assert p.answer(first, 1) and not p.answer(first, 2)  # a repeat changes nothing
    assert not p.answer(_answer(p, 0, Status.FAILED), 3)  # nor a different later answer
    p.answer(_answer(p, 1, Status.FAILED, "backend_error"), 4)
    p.answer(_answer(p, 3, Status.COMPLETED), 5)
    assert p.done and p.counts() == (4, 2, 2) and p.final[0] is first


def test_later_refusals_are_sent_again_under_a_new_id_after_their_wait():
    p = _progress(1)
    assert list(p.to_submit(0)) == [0]
    old = p.request_id(0)
    assert p.answer(_answer(p, 0, Status.REJECTED, "queue_full: x", retry_after_ms=500), 100)
    assert p.request_id(0) != old and not p.done
    assert list(p.to_submit(599)) == [] and list(p.to_submit(600)) == [0]
    assert not p.answer(Response.for_request(Request.new("t", "p", request_id=old), Status.REJECTED,
                                             reason="queue_full"), 700)  # the old attempt's repeat
    p.answer(_answer(p, 0, Status.COMPLETED), 800)
    assert p.done and p.counts() == (1, 1, 0)


def test_outstanding_is_bounded_and_a_restart_sends_the_rest_again():
    p = _progress(10, outstanding=3)
    assert list(p.to_submit(0)) == [0, 1, 2] and list(p.to_submit(0)) == []
    p.answer(_answer(p, 1, Status.COMPLETED), 1)
    assert list(p.to_submit(1)) == [3]
    p.resubmit_all()
    assert list(p.to_submit(2)) == [0, 2, 3]


def test_closing_gives_a_verdict_to_the_waiting_lines_and_then_to_the_outstanding():
    p = _progress(5, outstanding=2)
    list(p.to_submit(0))
    left = p.close(Verdict("batch_cancelled", "x"), outstanding_too=False)
    assert left == [0, 1] and not p.done
    p.answer(_answer(p, 0, Status.COMPLETED), 1)
    p.close(Verdict("batch_cancelled", "x"), outstanding_too=True)
    assert p.done and p.counts() == (5, 1, 4)


def test_expiry_is_final_once_the_window_closed():
    p = _progress(1, window_end=1000)
    list(p.to_submit(0))
    p.answer(_answer(p, 0, Status.EXPIRED), 2000)
    assert p.done and p.counts() == (1, 0, 1)
