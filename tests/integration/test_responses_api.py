"""OpenAI's Responses API on `llmq serve`, driven by the official `openai` client: the real broker, a
gateway process, a worker process (the simulated model, slow tokens) and a serve process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import openai
import pytest

from pipeline.serde import Codec
from pipeline.topics import create_pipeline_topics
from tests.integration.gateway.test_gateway import running_gateway
from tests.integration.harness import make_settings, read_topic
from tests.integration.test_serve import key_of, registry_file, running_serve

pytestmark = pytest.mark.slow

MS_PER_TOKEN = 120


def _worker(settings) -> subprocess.Popen:
    env = {**os.environ, **settings.topology_env(), "LLMQ_WORKER__COMMIT_INTERVAL_MS": "200",
           "LLMQ_WORKER__METRICS_PORT": "0", "LLMQ_WORKER__SIM_MS_PER_TOKEN": str(MS_PER_TOKEN),
           "LLMQ_WORKER__MAX_INFLIGHT": "16"}
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "--log-level", "WARNING", "worker", "--source",
                             "dispatch"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def _stack(bootstrap, tmp_path):
    s = make_settings(bootstrap)
    s.worker.source = "dispatch"
    create_pipeline_topics(s)
    registry = registry_file(tmp_path / "tenants.toml", "LLMQ_TEST_SIGNED_SECRET")
    env = {"LLMQ_TENANTS__FILE": str(registry), "LLMQ_TEST_SIGNED_SECRET": "x",
           "LLMQ_RESPONSES__RECOVER_INTERVAL_S": "1.0"}
    worker = _worker(s)
    try:
        with running_gateway(s, tmp_path, requests_per_window=1_000_000, env=env):
            with running_serve(s, tmp_path, registry, reply_partitions="1", env=env) as (url, proc, log):
                yield s, url, log
    finally:
        if worker.poll() is None:
            worker.kill()


def _client(url: str, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key_of(tenant), max_retries=2, timeout=60)


def _poll(client, response_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() < deadline, f"{response_id} stuck {r.status}"
        time.sleep(0.2)


def test_responses_api_with_the_openai_client(bootstrap, tmp_path):
    with _stack(bootstrap, tmp_path) as (settings, url, log):
        client = _client(url)
        # sync
        r = client.responses.create(model="sim-small", input="Hello there", max_output_tokens=4)
        assert r.status in ("completed", "incomplete"), r
        assert r.output_text and r.usage.output_tokens > 0 and r.usage.input_tokens > 0
        assert client.responses.retrieve(r.id).output_text == r.output_text

        # stream: OpenAI's events, numbered 0, 1, 2, ... , the text whole in the end
        events = list(client.responses.create(model="sim-small", input="Stream please", max_output_tokens=6,
                                              stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        types = [e.type for e in events]
        assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert types[-4:-1] == ["response.output_text.done", "response.content_part.done",
                                "response.output_item.done"]
        assert types[-1] in ("response.completed", "response.incomplete")
        final = events[-1].response
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
        assert final.usage is not None and final.usage.output_tokens > 0

        # background: queued at once, polled to the end
        bg = client.responses.create(model="sim-small", input="In the background", max_output_tokens=4,
                                     background=True)
        assert bg.status == "queued" and bg.background
        assert _poll(client, bg.id).status in ("completed", "incomplete")

        # cancel of a slow background response
        slow = client.responses.create(model="sim-small", input="Slowly", max_output_tokens=4, background=True,
                                       metadata={"sim.latency_ms": "30000"})
        time.sleep(0.5)
        assert client.responses.cancel(slow.id).status == "cancelled"
        assert client.responses.retrieve(slow.id).status == "cancelled"

        # a background stream dropped halfway, resumed with starting_after: every event once
        first = []
        with client.responses.create(model="sim-small", input="A long answer", max_output_tokens=16,
                                     background=True, stream=True) as stream:
            for event in stream:
                first.append(event)
                if event.type == "response.output_text.delta" and len(first) >= 7:
                    break
        rid = first[0].response.id
        rest = list(client.responses.retrieve(rid, stream=True, starting_after=first[-1].sequence_number))
        seen = [e.sequence_number for e in first + rest]
        assert seen == list(range(len(seen))), seen
        assert rest[-1].type in ("response.completed", "response.incomplete")
        text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
        assert text == rest[-1].response.output_text == client.responses.retrieve(rid).output_text

        # a two-turn conversation: the second turn's model input holds the first turn
        one = client.responses.create(model="sim-small", input="My name is Ada", max_output_tokens=4)
        two = client.responses.create(model="sim-small", input="What is my name?", previous_response_id=one.id,
                                      max_output_tokens=4)
        assert two.previous_response_id == one.id and two.status in ("completed", "incomplete")
        codec = Codec.default()
        sent = [codec.decode_request(m.value()) for m in read_topic(bootstrap, settings.topics.request_topic(
            __import__("pipeline.models", fromlist=["Priority"]).Priority.NORMAL))]
        second = [q for q in sent if q.messages and q.messages[-1]["content"] == "What is my name?"]
        assert second and second[-1].messages[:2] == [{"role": "user", "content": "My name is Ada"},
                                                      {"role": "assistant", "content": one.output_text}]
        assert [i.content[0].text for i in client.responses.input_items.list(two.id)] == ["What is my name?"]

        # service tiers: flex served flex, priority one band up
        assert client.responses.create(model="sim-small", input="cheap", max_output_tokens=2,
                                       service_tier="flex").service_tier == "flex"
        assert client.responses.create(model="sim-small", input="fast", max_output_tokens=2,
                                       service_tier="priority").service_tier == "priority"
        assert client.responses.create(model="sim-small", input="plain", max_output_tokens=2).service_tier == "default"

        # another tenant's key: 404, as an id that does not exist
        with pytest.raises(openai.NotFoundError):
            _client(url, "plain").responses.retrieve(one.id)
        with pytest.raises(openai.NotFoundError):
            _client(url, "plain").responses.create(model="sim-small", input="x", previous_response_id=one.id)
        # a field llmq cannot honour is named
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="sim-small", input="x", tools=[{"type": "web_search"}])
        assert refused.value.body["param"] == "tools"
        client.responses.delete(one.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(one.id)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_background_responses_survive_their_serve_process(bootstrap, tmp_path, sig):
    """serve stopped (SIGTERM) or killed (SIGKILL) while background responses run: a serve process
    started afterwards on another reply partition finishes every one from the responses topic."""
    import signal

    n = 100
    s = make_settings(bootstrap)
    s.worker.source = "dispatch"
    create_pipeline_topics(s)
    registry = registry_file(tmp_path / "tenants.toml", "LLMQ_TEST_SIGNED_SECRET")
    env = {"LLMQ_TENANTS__FILE": str(registry), "LLMQ_TEST_SIGNED_SECRET": "x",
           "LLMQ_RESPONSES__RECOVER_INTERVAL_S": "1.0"}
    worker = _worker(s)
    try:
        with running_gateway(s, tmp_path, requests_per_window=1_000_000, env=env):
            with running_serve(s, tmp_path, registry, reply_partitions="1", env=env, grace_s=1.0) as (url, proc, _):
                client = _client(url)
                ids = [client.responses.create(model="sim-small", input=f"question {i}", max_output_tokens=4,
                                               background=True).id for i in range(n)]
                proc.send_signal(getattr(signal, sig))
                proc.wait(30)
            with running_serve(s, tmp_path, registry, reply_partitions="2", env=env) as (url, _, log):
                client = _client(url)
                ended = [_poll(client, rid, timeout=120) for rid in ids]
                assert [r.status for r in ended] == ["completed"] * n or \
                    {r.status for r in ended} <= {"completed", "incomplete"}, {r.status for r in ended}
                assert all(r.output_text for r in ended)
    finally:
        if worker.poll() is None:
            worker.kill()
