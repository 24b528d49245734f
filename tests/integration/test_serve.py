"""`llmq serve` as deployed, driven by the official OpenAI client: the real broker, the real gateway
process, a worker, and serve processes of their own (their own reply partitions).

Tenants come from a registry file the gateway and serve share; live changes go through
`llmq tenants set` (the registry topic)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from pipeline.client import LlmqClient
from pipeline.models import Priority, Request, Status
from pipeline.serde import Codec
from pipeline.tenants.keys import hash_key
from pipeline.topics import create_pipeline_topics
from tests.integration.gateway.test_gateway import running_gateway
from tests.integration.harness import free_port, make_settings, read_topic, running_worker

pytestmark = pytest.mark.slow

#: Every tenant gets this many requests per (long) window from the gateway's [gateway.limits].
PER_WINDOW = 20
TENANTS = {  # name → (tier, max_priority, models)
    "acme": ("enterprise", "HIGH", []),
    "plain": ("standard", "NORMAL", []),
    "limited": ("standard", "CRITICAL", []),
    "small": ("free", "CRITICAL", ["sim-small"]),
    "batch": ("standard", "CRITICAL", []),
    "streamer": ("standard", "CRITICAL", []),
    "rich": ("enterprise", "CRITICAL", []),
}


def key_of(tenant: str) -> str:
    return f"test-key-{tenant}-0123456789"


def registry_file(path: Path, signed_secret_env: str) -> Path:
    lines = []
    for name, (tier, highest, models) in TENANTS.items():
        lines += [f"[{name}]", f'tier = "{tier}"', f'max_priority = "{highest}"', f"models = {models!r}",
                  f'key_hashes = ["{hash_key(key_of(name))}"]', ""]
    lines += ["[signed]", f'key_hashes = ["{hash_key(key_of("signed"))}"]', "require_signature = true",
              f'signing_secret = "env:{signed_secret_env}"', ""]
    path.write_text("\n".join(lines).replace("'", '"'))
    return path


def _env(settings, config: Path, extra: dict | None = None) -> dict:
    return {**os.environ, "LLMQ_CONFIG": str(config), **settings.topology_env(), **(extra or {})}


@contextlib.contextmanager
def running_serve(settings, tmp_path: Path, registry: Path, *, reply_partitions: str, grace_s: float = 10.0,
                  env: dict | None = None):
    """``llmq serve`` as a process; yields (base url, process, log path); SIGTERM on exit."""
    config = tmp_path / f"serve-{uuid.uuid4().hex[:6]}.toml"
    config.write_text(f'[tenants]\nfile = "{registry}"\n\n[serve]\nshutdown_grace_s = {grace_s}\n'
                      f"stream_heartbeat_s = 1.0\n")
    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--port", str(port),
                                 "--reply-partitions", reply_partitions], env=_env(settings, config, env),
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"serve did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url, proc, log_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise


@pytest.fixture(scope="module")
def stack(bootstrap, tmp_path_factory):
    """Topics, a gateway, a worker and one serve process, shared by this module's tests (each uses
    tenants of its own). Serve owns reply partition 0 of three."""
    tmp_path = tmp_path_factory.mktemp("serve")
    s = make_settings(bootstrap)
    s.worker.source = "dispatch"
    create_pipeline_topics(s)
    secret_env = "LLMQ_TEST_SIGNED_SECRET"
    registry = registry_file(tmp_path / "tenants.toml", secret_env)
    env = {"LLMQ_TENANTS__FILE": str(registry), secret_env: "signed-tenant-secret"}
    with running_gateway(s, tmp_path, requests_per_window=PER_WINDOW, env=env), running_worker(s), \
            running_serve(s, tmp_path, registry, reply_partitions="0", env=env) as (url, proc, log_path):
        yield {"settings": s, "url": url, "registry": registry, "tmp": tmp_path, "env": env, "log": log_path}


def _openai(stack, tenant: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack['url']}/v1", api_key=key_of(tenant), max_retries=0, **kw)


def _chat(client: openai.OpenAI, text: str = "hello", **kw):
    return client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": text}], **kw)


def test_a_chat_completion_is_answered(stack):
    resp = _chat(_openai(stack, "acme"), "what is a queue?")
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens > 0 and resp.model == "sim-small"
    models = [m.id for m in _openai(stack, "small").models.list()]
    assert models == ["sim-small"]


def test_a_bad_key_is_401_and_a_model_the_tenant_may_not_use_403(stack):
    with pytest.raises(openai.AuthenticationError) as err:
        _chat(openai.OpenAI(base_url=f"{stack['url']}/v1", api_key="not-a-key-of-anyone", max_retries=0))
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    assert "not-a-key-of-anyone" not in str(err.value)
    with pytest.raises(openai.PermissionDeniedError):
        _openai(stack, "small").chat.completions.create(model="sim-large", messages=[{"role": "user",
                                                                                       "content": "x"}])


def test_a_rate_limited_key_gets_429_with_retry_after(stack):
    client = _openai(stack, "limited")
    statuses, refused = [], None
    for i in range(PER_WINDOW + 3):
        try:
            _chat(client, f"request {i}")
            statuses.append(200)
        except openai.RateLimitError as exc:
            statuses.append(429)
            refused = exc
    assert statuses.count(200) == PER_WINDOW and statuses[PER_WINDOW:] == [429] * 3
    assert refused.code == "rate_limit_exceeded" and refused.body["message"].startswith("rate_limited: limit long_window")
    retry_after = int(refused.response.headers["Retry-After"])
    assert 1 <= retry_after <= 300


def test_background_work_is_accepted_at_once_and_polled_to_its_answer(stack):
    headers = {"Authorization": f"Bearer {key_of('batch')}"}
    accepted = httpx.post(f"{stack['url']}/v1/requests", headers=headers, timeout=10,
                          json={"model": "sim-small", "messages": [{"role": "user", "content": "summarise"}]})
    assert accepted.status_code == 202, accepted.text
    doc = accepted.json()
    assert doc["priority"] == "BACKGROUND" and doc["status"] in ("queued", "completed")
    if doc["status"] == "queued":
        assert doc["queue_position"] is not None
    deadline = time.monotonic() + 30
    while True:
        polled = httpx.get(f"{stack['url']}/v1/requests/{doc['id']}", headers=headers, timeout=10).json()
        if polled["status"] not in ("queued", "submitted") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert polled["status"] == "completed", polled
    assert polled["response"]["choices"][0]["message"]["content"]
    other = httpx.get(f"{stack['url']}/v1/requests/{doc['id']}", timeout=10,
                      headers={"Authorization": f"Bearer {key_of('acme')}"})
    assert other.status_code == 404  # another tenant's id is unknown to it


def test_a_streamed_chat_arrives_as_server_sent_events(stack):
    client = _openai(stack, "streamer")
    whole = _chat(client, "stream this please").choices[0].message.content
    # A latency of its own: a zero-latency simulated answer is given whole, not streamed.
    events = list(_chat(client, "stream this please", stream=True, stream_options={"include_usage": True},
                        metadata={"sim.latency_ms": "20"}))
    texts = [e.choices[0].delta.content or "" for e in events if e.choices]
    finishes = [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason]
    assert "".join(texts) == whole  # the simulated model answers a prompt the same way every time
    assert len([t for t in texts if t]) > 1, "the worker streamed its answer in pieces"
    assert finishes == ["stop"] or finishes == ["length"]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens > 0
    assert all(e.id == events[0].id for e in events)


def test_a_key_cannot_raise_its_tier_or_band_nor_spend_another_tenants_quota(stack):
    # "plain" is standard with max_priority NORMAL; "rich" is enterprise (tier offset -1: one band up).
    plain, rich = _openai(stack, "plain"), _openai(stack, "rich")
    claims = {"extra_body": {"user_tier": "enterprise", "tenant_id": "rich"},
              "extra_headers": {"x-llmq-priority": "critical"}}
    raw = plain.chat.completions.with_raw_response.create(
        model="sim-small", messages=[{"role": "user", "content": "let me in"}], **claims)
    assert raw.headers["x-llmq-served-priority"] == "NORMAL"  # capped, and no enterprise promotion
    up = rich.chat.completions.with_raw_response.create(
        model="sim-small", messages=[{"role": "user", "content": "normal please"}],
        extra_headers={"x-llmq-priority": "normal"})
    assert up.headers["x-llmq-served-priority"] == "HIGH"  # what enterprise would have given
    # plain spends its own window, never rich's.
    for i in range(PER_WINDOW):
        try:
            _chat(plain, f"spend {i}")
        except openai.RateLimitError:
            break
    else:
        raise AssertionError("plain was never rate limited")
    assert _chat(rich, "still mine").choices[0].message.content


def test_llmq_submit_goes_through_serve_with_a_key_file(stack):
    key_file = stack["tmp"] / "batch.key"
    key_file.write_text(key_of("batch") + "\n")

    def submit(*argv):
        return subprocess.run([sys.executable, "-m", "pipeline.cli", "submit", "--via", stack["url"], "--key-file",
                               str(key_file), *argv], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "LLMQ_BOOTSTRAP": "127.0.0.1:1"})  # Kafka never reached

    waited = submit("--priority", "high", "hello over http")
    assert waited.returncode == 0 and waited.stdout.startswith("COMPLETED: "), waited.stderr
    queued = submit("--no-wait", "later please")
    assert queued.returncode == 0 and str(uuid.UUID(queued.stdout.strip())) == queued.stdout.strip()
    assert key_of("batch") not in waited.stdout + waited.stderr + queued.stdout + queued.stderr


def _gateway_applies_the_registry() -> bool:
    source = Path(__file__).resolve().parents[2] / "pipeline" / "gateway" / "intake.py"
    return "authorize" in source.read_text()


def test_a_new_key_and_a_revoked_one_take_effect_without_restarts(stack):
    s, env = stack["settings"], stack["env"]
    key_file = stack["tmp"] / "newco.key"
    key_file.write_text("newco-live-key-0123456789\n")
    config = stack["tmp"] / "tenants-cli.toml"
    config.write_text(f'[tenants]\nfile = "{stack["registry"]}"\n')

    def tenants(*argv):
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", "tenants", *argv], env=_env(s, config, env),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    client = openai.OpenAI(base_url=f"{stack['url']}/v1", api_key="newco-live-key-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    tenants("set", "newco", "--tier", "standard", "--key-file", str(key_file))
    written = time.monotonic()
    while True:
        try:
            client.models.list()
            break
        except openai.AuthenticationError:
            assert time.monotonic() - written < 2.0, "a new key was not honoured within 2 s"
            time.sleep(0.02)
    took = time.monotonic() - written
    print(f"\nnew key honoured {took * 1000:.0f} ms after `llmq tenants set` returned")
    assert "newco" in tenants("list")
    tenants("set", "newco", "--revoke-keys")
    revoked = time.monotonic()
    while True:
        try:
            client.models.list()
        except openai.AuthenticationError:
            break
        assert time.monotonic() - revoked < 2.0, "a revoked key still worked after 2 s"
        time.sleep(0.02)
    print(f"revoked key refused {(time.monotonic() - revoked) * 1000:.0f} ms after `llmq tenants set` returned")


@pytest.mark.skipif(not _gateway_applies_the_registry(),
                    reason="needs the gateway to call the registry's authorize() in intake (pipeline/gateway)")
def test_a_new_limit_in_the_registry_holds_at_the_gateway_within_2s(stack):
    """Needs the gateway wired to the registry: its limits replace [gateway.limits] for the tenant."""
    s = stack["settings"]
    from pipeline.tenants.record import TenantRecord
    from pipeline.tenants.registry import TenantRegistry

    key = "tuned-live-key-0123456789"
    registry = TenantRegistry(s)
    registry.publish(TenantRecord("tuned", key_hashes=(hash_key(key),)))
    client = openai.OpenAI(base_url=f"{stack['url']}/v1", api_key=key, max_retries=0)
    deadline = time.monotonic() + 5
    while True:  # serve knows the key
        try:
            _chat(client, "warm up")
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    from pipeline.config.gateway import RateLimitSettings

    registry.publish(TenantRecord("tuned", key_hashes=(hash_key(key),),
                                  limits=(RateLimitSettings("one_per_window", 300_000, requests=1, over="refuse"),)))
    written = time.monotonic()
    while True:
        try:
            _chat(client, "probe")
        except openai.RateLimitError as exc:
            assert "one_per_window" in exc.message
            break
        assert time.monotonic() - written < 2.0, "the new limit did not hold within 2 s"
        time.sleep(0.05)
    print(f"\nnew limit held {(time.monotonic() - written) * 1000:.0f} ms after it was written")


@pytest.mark.skipif(not _gateway_applies_the_registry(),
                    reason="needs the gateway to call the registry's authorize() in intake (pipeline/gateway)")
def test_unsigned_requests_for_a_signing_tenant_are_refused_at_the_gateway(stack):
    """Needs the gateway wired to the registry. A producer with Kafka access writing as "signed"
    without its secret is refused; serve (which holds the secret) gets through."""
    s = stack["settings"]
    forged = Request.new("signed", "impersonation", priority=Priority.HIGH)
    with LlmqClient(s) as client:
        client.submit(forged)
        answer = client.result(forged.request_id, timeout=30)
    assert answer.status is Status.REJECTED and answer.reason.startswith("unauthorized: ")
    assert _chat(_openai(stack, "signed"), "signed by serve").choices[0].message.content


def test_serve_stops_gracefully_finishing_what_is_in_flight(stack):
    s, tmp = stack["settings"], stack["tmp"]
    with running_serve(s, tmp, stack["registry"], reply_partitions="0", grace_s=10.0, env=stack["env"]) \
            as (url, proc, log_path):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key_of("acme"), max_retries=0)
        result: list = []
        slow = threading.Thread(target=lambda: result.append(_chat(
            client, "take your time", metadata={"sim.latency_ms": "1500"})))
        slow.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        slow.join(20)
        assert proc.wait(20) == 0
        assert result and result[0].choices[0].message.content  # answered, not cut off
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/healthz", timeout=1)
        log = log_path.read_text()
    # Logs stay quiet: start and stop lines, nothing per request, never a key.
    assert key_of("acme") not in log and len(log.splitlines()) < 15, log


@pytest.fixture
def isolated(bootstrap, tmp_path):
    """Three response partitions, a gateway and a worker: answers go to the partition a request names."""
    s = make_settings(bootstrap)
    s.worker.source = "dispatch"
    create_pipeline_topics(s)
    with running_gateway(s, tmp_path), running_worker(s):
        yield s


def test_a_client_reading_its_reply_partition_never_sees_another_tenants_answer(isolated):
    s = isolated
    codec = Codec.default()
    queued = 0
    with LlmqClient(s, reply_partitions=[1]) as a, LlmqClient(s, reply_partitions=[2]) as b:
        for i in range(10):
            for client, tenant in ((a, "tenant-a"), (b, "tenant-b")):
                req = Request.new(tenant, f"mine {i}", notify_queued=i % 2 == 0)
                sub = client.submit(req)
                if req.notify_queued:
                    # The first word: where it is queued, or its answer if a fast worker's answer
                    # overtook it (Kafka orders nothing across the dispatch and responses topics).
                    assert sub.status is Status.COMPLETED or (
                        sub.status is Status.QUEUED and sub.queue_position is not None), sub
                    queued += sub.status is Status.QUEUED
                assert client.result(req.request_id, timeout=30).status is Status.COMPLETED
        assert queued, "no QUEUED word reached its client's partition"
        with a.stream(Request.new("tenant-a", "stream to a", metadata={"sim.latency_ms": "20"})) as stream:
            assert "".join(c.delta for c in stream) == stream.response.output
    by_partition: dict[int, set] = {}
    for topic in (s.topics.responses, s.topics.chunks):
        for msg in read_topic(s.kafka.bootstrap, topic):
            record = codec.decode_response(msg.value()) if topic == s.topics.responses \
                else codec.decode_chunk(msg.value())
            by_partition.setdefault(msg.partition(), set()).add(record.tenant_id)
    assert by_partition[1] == {"tenant-a"} and by_partition[2] == {"tenant-b"}
    assert 0 not in by_partition
