"""OpenAI's Batch API on `llmq serve`, driven by the official `openai` client: the real broker, a
gateway process, a worker process and serve processes, with serve and the worker SIGTERMed and
SIGKILLed mid-batch."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from pipeline.models import Request
from pipeline.topics import create_pipeline_topics
from pipeline.worker.backends.simulated import SimulatedBackend
from tests.integration.gateway.test_gateway import running_gateway
from tests.integration.harness import make_settings
from tests.integration.test_serve import key_of, registry_file, running_serve

pytestmark = pytest.mark.slow

OVER_LIMIT_PROMPT = "x" * 900_000


def _worker(settings, latency_ms: int) -> subprocess.Popen:
    env = {**os.environ, **settings.topology_env(), "LLMQ_WORKER__COMMIT_INTERVAL_MS": "200",
           "LLMQ_WORKER__METRICS_PORT": "0", "LLMQ_WORKER__SESSION_TIMEOUT_MS": "6000",
           "LLMQ_WORKER__SIM_LATENCY_MS": str(latency_ms), "LLMQ_WORKER__MAX_INFLIGHT": "16"}
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "--log-level", "WARNING", "worker", "--source",
                             "dispatch"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def _pipeline(bootstrap, tmp_path, latency_ms: int = 5, **batch):
    s = make_settings(bootstrap)
    s.worker.source = "dispatch"
    create_pipeline_topics(s)
    registry = registry_file(tmp_path / "tenants.toml", "LLMQ_TEST_SIGNED_SECRET")
    env = {"LLMQ_TENANTS__FILE": str(registry), "LLMQ_TEST_SIGNED_SECRET": "x",
           "LLMQ_BATCH__SESSION_TIMEOUT_MS": "6000", **{f"LLMQ_BATCH__{k.upper()}": str(v) for k, v in batch.items()}}
    worker = _worker(s, latency_ms)
    try:
        with running_gateway(s, tmp_path, requests_per_window=1_000_000, env=env):
            yield s, registry, env, worker
    finally:
        if worker.poll() is None:
            worker.kill()


def _client(url: str, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key_of(tenant), max_retries=2)


def _line(i: int, latency_ms: int | None = None, **body) -> dict:
    body = {"model": "sim-small", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 8, **body}
    if latency_ms is not None:
        body["metadata"] = {"sim.latency_ms": str(latency_ms)}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _upload(client: openai.OpenAI, lines: list) -> str:
    data = "".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id


def _wait(client: openai.OpenAI, batch_id: str, until=lambda b: b.status in ("completed", "failed", "expired",
                                                                                    "cancelled"), timeout=180.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} stuck: {batch.status} {batch.request_counts}"
        time.sleep(0.5)


def _jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def _expected(i: int) -> str:
    req = Request.new("x", None, model="sim-small", max_tokens=8,
                      messages=[{"role": "user", "content": f"question {i}"}])
    return SimulatedBackend().answer(req).output


def _check_complete(client, batch, n_good: int) -> tuple[list, list]:
    """Every good line once in the output, with its own answer; counts exact."""
    out, err = _jsonl(client, batch.output_file_id), _jsonl(client, batch.error_file_id)
    ids = [o["custom_id"] for o in out]
    assert len(ids) == len(set(ids)) == n_good, (len(ids), len(set(ids)), n_good)
    for o in out:
        i = int(o["custom_id"].split("-")[1])
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["choices"][0]["message"]["content"] == _expected(i)
        assert o["response"]["body"]["id"] == "chatcmpl-" + o["response"]["request_id"]
    assert {e["custom_id"] for e in err} & set(ids) <= {"req-0"}  # the line that repeats req-0's id
    assert batch.request_counts.total == len(out) + len(err)
    assert batch.request_counts.completed == len(out) and batch.request_counts.failed == len(err)
    return out, err


def test_a_batch_runs_to_completed_with_bad_lines_in_the_error_file(bootstrap, tmp_path):
    with _pipeline(bootstrap, tmp_path) as (s, registry, env, _), \
            running_serve(s, tmp_path, registry, reply_partitions="0", env=env) as (url, _, log):
        client = _client(url)
        good = [_line(i) for i in range(40)]
        bad = ["{not json\n", _line(100) | {"url": "/v1/completions"}, _line(101, messages=[]),
               _line(102) | {"custom_id": "req-0"}, _line(103, messages=[{"role": "user", "content": OVER_LIMIT_PROMPT}])]
        file_id = _upload(client, good[:20] + bad + good[20:])
        assert client.files.retrieve(file_id).purpose == "batch"
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"job": "nightly"})
        assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
        assert batch.id in [b.id for b in client.batches.list()]
        done = _wait(client, batch.id)
        assert done.status == "completed", (done, log.read_text()[-3000:])
        assert done.request_counts.total == 45
        _, err = _check_complete(client, done, 40)
        reasons = {e["custom_id"]: (e["error"] or e["response"]["body"]["error"])["message"] for e in err}
        assert len(err) == 5 and "repeats" in reasons["req-0"] and "url" in reasons["req-100"]
        assert "messages" in reasons["req-101"] and "exceed max_" in reasons["req-103"]  # the limit named
        assert any("JSON" in r for r in reasons.values())

        # another tenant's key sees none of it
        other = _client(url, "plain")
        for call in (lambda: other.batches.retrieve(batch.id), lambda: other.files.retrieve(file_id),
                     lambda: other.files.content(done.output_file_id), lambda: other.batches.cancel(batch.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert batch.id not in [b.id for b in other.batches.list()]
        assert client.files.delete(file_id).deleted
        # the same prompt outside a batch: 400 naming the limit, not a 500 or a wait
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="sim-small", prompt=OVER_LIMIT_PROMPT, max_tokens=4)
        assert "max_prompt_bytes" in str(refused.value) and "/" not in refused.value.message
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)


def test_cancel_stops_the_lines_not_started_and_keeps_what_finished(bootstrap, tmp_path):
    with _pipeline(bootstrap, tmp_path) as (s, registry, env, _), \
            running_serve(s, tmp_path, registry, reply_partitions="0", env=env) as (url, _, log):
        client = _client(url)
        file_id = _upload(client, [_line(i, latency_ms=300) for i in range(3000)])
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        _wait(client, batch.id, until=lambda b: b.request_counts.completed >= 20)
        assert client.batches.cancel(batch.id).status == "cancelling"
        done = _wait(client, batch.id, timeout=60)
        assert done.status == "cancelled" and done.cancelled_at
        out, err = _jsonl(client, done.output_file_id), _jsonl(client, done.error_file_id)
        assert len(out) >= 20 and len(out) + len(err) == 3000 == done.request_counts.total
        assert len({x["custom_id"] for x in out + err}) == 3000
        assert {e["error"]["code"] for e in err if e["error"]} <= {"batch_cancelled"}
        assert done.request_counts.completed == len(out)


def test_the_window_closing_expires_the_lines_not_started(bootstrap, tmp_path):
    with _pipeline(bootstrap, tmp_path) as (s, registry, env, _), \
            running_serve(s, tmp_path, registry, reply_partitions="0", env=env) as (url, _, log):
        client = _client(url)
        file_id = _upload(client, [_line(i, latency_ms=200) for i in range(3000)])
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="4s")
        done = _wait(client, batch.id, timeout=90)
        assert done.status == "expired" and done.expired_at
        out, err = _jsonl(client, done.output_file_id), _jsonl(client, done.error_file_id)
        assert out and len(out) + len(err) == 3000 == done.request_counts.total
        assert len({x["custom_id"] for x in out + err}) == 3000
        assert {e["error"]["code"] if e["error"] else e["response"]["body"]["error"]["code"] for e in err} <= {
            "batch_expired", "expired"}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_serve_and_a_worker_stopped_mid_batch_the_batch_completes_exactly(bootstrap, tmp_path, sig):
    n = 600
    # a window of 50 lines in flight: most lines are still to send when serve goes down
    with _pipeline(bootstrap, tmp_path, latency_ms=20, max_outstanding=50) as (s, registry, env, worker):
        with running_serve(s, tmp_path, registry, reply_partitions="0", env=env) as (url, proc, _):
            client = _client(url)
            file_id = _upload(client, [_line(i) for i in range(n)])
            batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            _wait(client, batch.id, until=lambda b: b.request_counts.completed >= 100)
            proc.send_signal(sig)
            proc.wait(30)
        # the worker goes down while no serve drives the batch, and comes back
        worker.send_signal(sig)
        worker.wait(30)
        worker = _worker(s, 20)
        try:
            with running_serve(s, tmp_path, registry, reply_partitions="1", env=env) as (url, _, log):
                client = _client(url)
                mid = _wait(client, batch.id, until=lambda b: b.request_counts.completed >= 300 or
                            b.status == "completed")
                assert mid.request_counts.completed <= n
                worker.send_signal(sig)
                worker.wait(30)
                worker = _worker(s, 20)
                done = _wait(client, batch.id)
                assert done.status == "completed", log.read_text()[-3000:]
                _check_complete(client, done, n)
                assert done.request_counts.failed == 0
        finally:
            if worker.poll() is None:
                worker.kill()
