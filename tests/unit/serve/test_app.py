"""llmq serve's endpoints against a scripted client: shapes, auth, priorities, errors, streams, batch."""

from __future__ import annotations

import asyncio
import json

from pipeline.models import Priority, Response, Status
from pipeline.serve.runner import _drain
from tests.unit.serve.conftest import auth, chunks, completed, running

CHAT = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}


def run(coro):
    return asyncio.run(coro)


def _events(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_chat_completion_in_openais_shape():
    async def go():
        async with running(lambda req: [completed(req, "hello there")]) as (http, server, fake):
            r = await http.post("/v1/chat/completions", json=CHAT, headers=auth())
            return r.status, await r.json(), r.headers, fake.sent
    status, body, headers, sent = run(go())
    assert status == 200
    [req] = sent
    assert body["id"] == f"chatcmpl-{req.request_id}" and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hello there"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert headers["x-llmq-request-id"] == req.request_id and headers["x-llmq-reply-partition"] == "0"
    # The tenant and tier are the key's record's; the request names the reply partition.
    assert req.tenant_id == "acme" and req.user_tier == "enterprise" and req.reply_partition == 0
    assert req.messages == [{"role": "user", "content": "hi"}] and req.priority is Priority.NORMAL


def test_a_completion_and_the_priority_header_capped_by_the_registry():
    async def go():
        async with running(lambda req: [completed(req, "text")]) as (http, server, fake):
            r = await http.post("/v1/completions", json={"model": "sim-small", "prompt": "say", "max_tokens": 7},
                                headers=auth(**{"x-llmq-priority": "critical"}))
            meta = await http.post("/v1/chat/completions", headers=auth("beta"),
                                   json={**CHAT, "metadata": {"priority": "low", "job": "x"}})
            return r.status, await r.json(), meta.status, fake.sent
    status, body, meta_status, sent = run(go())
    assert status == 200 and body["object"] == "text_completion" and body["choices"][0]["text"] == "text"
    assert sent[0].priority is Priority.HIGH and sent[0].max_tokens == 7 and sent[0].prompt == "say"
    assert meta_status == 200 and sent[1].priority is Priority.LOW and sent[1].metadata == {"job": "x"}
    assert sent[1].user_tier == "free"


def test_a_tier_claimed_in_the_body_is_not_honoured():
    async def go():
        async with running(lambda req: [completed(req)]) as (http, server, fake):
            await http.post("/v1/chat/completions", json={**CHAT, "user_tier": "enterprise", "tenant_id": "acme"},
                            headers=auth("beta"))
            return fake.sent
    [req] = run(go())
    assert req.tenant_id == "beta" and req.user_tier == "free"


def test_keys_missing_wrong_or_disabled_get_401_and_a_forbidden_model_403():
    async def go():
        async with running(lambda req: [completed(req)]) as (http, server, fake):
            out = []
            for headers in ({}, {"Authorization": "Bearer wrong-key-123456789"}, auth("off"),
                            {"Authorization": "Basic abc"}):
                r = await http.post("/v1/chat/completions", json=CHAT, headers=headers)
                out.append((r.status, await r.json()))
            r = await http.post("/v1/chat/completions", json={**CHAT, "model": "sim-large"}, headers=auth("beta"))
            out.append((r.status, await r.json()))
            return out, fake.sent
    out, sent = run(go())
    assert [s for s, _ in out] == [401, 401, 401, 401, 403]
    for _, body in out:
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert "wrong-key" not in body["error"]["message"]
    assert out[1][1]["error"]["code"] == "invalid_api_key"
    assert out[4][1]["error"]["code"] == "model_not_allowed"
    assert sent == []  # nothing reached Kafka


def test_refusals_map_to_http_statuses_with_retry_after():
    def script(req):
        reason = {"a": ("rate_limited: limit per_second: 1 requests per 1000 ms", Status.REJECTED, 1500),
                  "b": ("queue_full: band NORMAL holds 9 requests (cap 9)", Status.REJECTED, 200),
                  "c": ("expired: deadline cannot be met", Status.EXPIRED, None),
                  "d": ("backend_error: the model server answered 500", Status.FAILED, None),
                  "e": ("invalid_request: temperature must be a number from 0 to 2", Status.REJECTED, None),
                  }[req.messages[0]["content"]]
        return [Response.for_request(req, reason[1], reason=reason[0], retry_after_ms=reason[2])]

    async def go():
        async with running(script) as (http, server, fake):
            out = {}
            for case in "abcde":
                r = await http.post("/v1/chat/completions", headers=auth(),
                                    json={**CHAT, "messages": [{"role": "user", "content": case}]})
                out[case] = (r.status, r.headers.get("Retry-After"), await r.json())
            return out
    out = run(go())
    assert out["a"][:2] == (429, "2") and out["a"][2]["error"]["code"] == "rate_limit_exceeded"
    assert out["a"][2]["error"]["message"].startswith("rate_limited: limit per_second")
    assert out["b"][:2] == (429, "1") and out["b"][2]["error"]["code"] == "queue_full"
    assert out["c"][0] == 504 and out["c"][2]["error"]["code"] == "expired"
    assert out["d"][0] == 502 and out["e"][0] == 400


def test_bad_input_is_400_with_the_reason_and_unknown_routes_keep_the_error_shape():
    async def go():
        async with running(lambda req: [completed(req)]) as (http, server, fake):
            out = []
            for body in (b"{not json", json.dumps({"model": "sim-small"}).encode(),
                         json.dumps({**CHAT, "n": 2}).encode(), json.dumps({**CHAT, "temperature": 7}).encode(),
                         json.dumps({**CHAT, "tools": [{"type": "function"}]}).encode()):
                r = await http.post("/v1/chat/completions", data=body, headers=auth())
                out.append((r.status, (await r.json())["error"]))
            r = await http.post("/v1/chat/completions", json=CHAT, headers=auth(**{"x-llmq-priority": "urgent"}))
            out.append((r.status, (await r.json())["error"]))
            r = await http.get("/v1/nowhere", headers=auth())
            out.append((r.status, (await r.json())["error"]))
            return out, fake.sent
    out, sent = run(go())
    assert [s for s, _ in out] == [400, 400, 400, 400, 400, 400, 404]
    assert "not valid JSON" in out[0][1]["message"] and out[1][1]["param"] == "messages"
    assert out[2][1]["param"] == "n" and out[3][1]["message"].startswith("invalid_request: temperature")
    assert out[4][1]["code"] == "unsupported_parameter" and out[5][1]["param"] == "x-llmq-priority"
    assert sent == []


def test_no_answer_before_the_deadline_is_504_and_the_request_is_cancelled():
    async def go():
        async with running(lambda req: []) as (http, server, fake):
            r = await http.post("/v1/chat/completions", json=CHAT, headers=auth(**{"x-llmq-timeout-ms": "10"}))
            await asyncio.sleep(0.05)
            return r.status, await r.json(), fake.cancelled, fake.sent
    status, body, cancelled, sent = run(go())
    assert status == 504 and body["error"]["code"] == "expired"
    assert cancelled and cancelled[0][0] == sent[0].request_id


def test_a_write_kafka_does_not_take_in_time_is_a_503_with_retry_after_and_is_withdrawn():
    async def go():
        async with running(lambda req: [], kafka_down=True, submit_timeout_ms=50) as (http, server, fake):
            loop = asyncio.get_running_loop()
            started = loop.time()
            plain = await http.post("/v1/chat/completions", json=CHAT, headers=auth())
            took = loop.time() - started
            streamed = await http.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth())
            await asyncio.sleep(0.05)
            return (plain.status, plain.headers.get("Retry-After"), await plain.json(), took, streamed.status,
                    fake.cancelled)
    status, retry_after, body, took, streamed, cancelled = run(go())
    assert status == 503 and retry_after == "2" and body["error"]["code"] == "kafka_unavailable"
    assert took < 1.0  # the submit timeout, not the 60-s deadline
    assert streamed == 503
    assert len(cancelled) == 2


def test_a_stream_as_server_sent_events_with_usage_and_done():
    def script(req):
        return [*chunks(req, ["hel", "lo"]), (0.05, completed(req, "hello"))]

    async def go():
        async with running(script) as (http, server, fake):
            r = await http.post("/v1/chat/completions", headers=auth(),
                                json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
            return r.status, r.headers["Content-Type"], await r.text(), fake.sent
    status, ctype, text, [req] = run(go())
    assert status == 200 and ctype.startswith("text/event-stream") and req.stream
    events = _events(text)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"].get("content") for e in events[1:-1] if e["choices"]]
    assert "".join(d for d in deltas if d) == "hello"
    assert [e["choices"][0]["finish_reason"] for e in events[1:-1] if e["choices"]][-1] == "stop"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] == 5
    assert all(e["id"] == f"chatcmpl-{req.request_id}" and e["object"] == "chat.completion.chunk"
               for e in events[:-1])


def test_a_refused_stream_gets_its_status_not_a_stream():
    async def go():
        async with running(lambda req: [Response.for_request(req, Status.REJECTED, retry_after_ms=3000,
                                                             reason="rate_limited: limit x: 1 requests per 1 ms")]) \
                as (http, server, fake):
            r = await http.post("/v1/completions", headers=auth(),
                                json={"model": "sim-small", "prompt": "p", "stream": True})
            return r.status, r.headers.get("Retry-After"), await r.json()
    status, retry, body = run(go())
    assert status == 429 and retry == "3" and body["error"]["code"] == "rate_limit_exceeded"


def test_a_slow_stream_keeps_alive_and_a_stream_without_chunks_still_streams_the_answer():
    async def go():
        async with running(lambda req: [(0.5, completed(req, "whole answer"))]) as (http, server, fake):
            r = await http.post("/v1/completions", headers=auth(),
                                json={"model": "sim-small", "prompt": "p", "stream": True})
            return await r.text()
    text = run(go())
    assert ": keep-alive" in text
    events = _events(text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "whole answer" and events[-1] == "[DONE]"


def test_batch_requests_are_accepted_with_their_queue_position_then_polled_to_the_answer():
    def script(req):
        queued = Response.for_request(req, Status.QUEUED, queue_position=4, eta_ms=900,
                                      served_priority=req.priority)
        return [queued, (0.1, completed(req, "batch done"))]

    async def go():
        async with running(script) as (http, server, fake):
            r = await http.post("/v1/requests", json=CHAT, headers=auth())
            accepted = (r.status, await r.json())
            rid = accepted[1]["id"]
            first = await (await http.get(f"/v1/requests/{rid}", headers=auth())).json()
            other = await http.get(f"/v1/requests/{rid}", headers=auth("beta"))
            await asyncio.sleep(0.2)
            last = await (await http.get(f"/v1/requests/{rid}", headers=auth())).json()
            return accepted, first, other.status, last, fake.sent
    (status, body), first, other, last, [req] = run(go())
    assert status == 202 and body["status"] == "queued" and body["queue_position"] == 4 and body["eta_ms"] == 900
    assert req.priority is Priority.BACKGROUND and req.notify_queued
    assert first["status"] == "queued"
    assert other == 404  # another tenant cannot see it
    assert last["status"] == "completed" and last["response"]["choices"][0]["message"]["content"] == "batch done"


def test_a_batch_request_refused_at_once_gets_the_refusal_status():
    async def go():
        async with running(lambda req: [Response.for_request(req, Status.REJECTED, retry_after_ms=5000,
                                                             reason="quota_exceeded: too many")]) \
                as (http, server, fake):
            r = await http.post("/v1/requests", json={"model": "sim-small", "prompt": "p"}, headers=auth())
            return r.status, r.headers.get("Retry-After")
    assert run(go()) == (429, "5")


def test_models_are_what_the_pools_serve_within_the_tenants_own_list():
    async def go():
        async with running(lambda req: [], aliases={"gpt-4o-mini": "sim-small", "stale": "gone"}) as (http, _, _f):
            beta = await (await http.get("/v1/models", headers=auth("beta"))).json()
            acme = await (await http.get("/v1/models", headers=auth())).json()
            one = await http.get("/v1/models/sim-large", headers=auth("beta"))
            alias = await http.get("/v1/models/gpt-4o-mini", headers=auth())
            return beta, acme, one.status, alias.status
    beta, acme, one, alias = run(go())
    assert [m["id"] for m in beta["data"]] == ["sim-small"] and beta["object"] == "list"
    # an alias is listed once its target is served; one whose target nobody serves is not
    assert [m["id"] for m in acme["data"]] == ["sim-small", "sim-large", "gpt-4o-mini"]
    assert one == 404 and alias == 200


def test_before_any_pool_has_published_only_the_tenants_own_list_is_shown_and_nothing_is_refused():
    async def go():
        async with running(lambda req: [completed(req, "ok")], served=None) as (http, _, fake):
            beta = await (await http.get("/v1/models", headers=auth("beta"))).json()
            acme = await (await http.get("/v1/models", headers=auth())).json()
            r = await http.post("/v1/chat/completions", headers=auth(),
                                json={"model": "whatever", "messages": [{"role": "user", "content": "x"}]})
            return beta, acme, r.status, [q.model for q in fake.sent]
    beta, acme, status, sent = run(go())
    assert [m["id"] for m in beta["data"]] == ["sim-small"] and acme["data"] == []
    assert status == 200 and sent == ["whatever"]


def test_a_model_no_pool_serves_is_404_model_not_found_before_anything_is_written():
    async def go():
        async with running(lambda req: [completed(req, "ok")], served=("qwen-0.5b",)) as (http, _, fake):
            r = await http.post("/v1/chat/completions", headers=auth(),
                                json={"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]})
            return r.status, await r.json(), fake.sent
    status, body, sent = run(go())
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert "'gpt-4o'" in body["error"]["message"] and "qwen-0.5b" in body["error"]["message"]
    assert sent == []


def test_a_request_that_names_no_model_runs_on_the_served_default():
    async def go():
        async with running(lambda req: [completed(req, "ok")], served=("qwen-0.5b",)) as (http, _, fake):
            r = await http.post("/v1/requests", headers=auth(), json={"prompt": "p"})
            return r.status, [q.model for q in fake.sent]
    status, sent = run(go())
    assert status in (200, 202) and sent == ["qwen-0.5b"]


def test_draining_answers_new_requests_503_and_requests_past_the_grace_period_503():
    async def go():
        async with running(lambda req: []) as (http, server, fake):
            waiting = asyncio.ensure_future(http.post("/v1/chat/completions", json=CHAT, headers=auth()))
            await asyncio.sleep(0.1)
            assert server.inflight == 1

            class _Site:
                async def stop(self):
                    pass
            drain = asyncio.ensure_future(_drain(server, _Site(), 0.2))
            await asyncio.sleep(0.05)
            late = await http.post("/v1/chat/completions", json=CHAT, headers=auth())
            health = await http.get("/healthz")
            r = await waiting
            await drain
            return late.status, health.status, r.status, (await r.json())["error"]["code"], fake.cancelled
    late, health, status, code, cancelled = run(go())
    assert late == 503 and health == 503
    assert status == 503 and code == "shutting_down" and cancelled


def test_health_while_serving():
    async def go():
        async with running(lambda req: []) as (http, server, fake):
            r = await http.get("/healthz")
            return r.status, await r.json()
    status, body = run(go())
    assert status == 200 and body["status"] == "ok" and body["reply_partitions"] == [0]


def test_metrics_count_requests_by_route_pattern_and_status():
    async def go():
        async with running(lambda req: [completed(req, "ok")]) as (http, _, _f):
            await http.post("/v1/chat/completions", json=CHAT, headers=auth())
            await http.get("/v1/models/nope", headers=auth())
            await http.get("/v1/no-such-thing")
            return await (await http.get("/metrics")).text()
    text = run(go())
    assert 'llmq_serve_requests_total{code="200",method="POST",route="/v1/chat/completions"} 1.0' in text
    assert 'llmq_serve_requests_total{code="404",method="GET",route="/v1/models/{model}"} 1.0' in text
    assert 'method="GET",route="unmatched"' in text and "/v1/no-such-thing" not in text
    assert 'llmq_serve_request_seconds_count{route="/v1/chat/completions"} 1.0' in text
    assert "llmq_serve_inflight 0.0" in text and "llmq_serve_open_streams 0.0" in text


def test_readyz_is_200_while_serving_and_503_with_reasons_while_draining():
    async def go():
        async with running(lambda req: []) as (http, server, _f):
            serving = await http.get("/readyz")
            first = (serving.status, await serving.json())
            server.draining = True
            draining = await http.get("/readyz")
            return first, (draining.status, await draining.json())
    (ok, ok_doc), (no, no_doc) = run(go())
    assert ok == 200 and ok_doc["status"] == "ok"
    assert no == 503 and no_doc["reasons"] and "drain" in " ".join(no_doc["reasons"])
