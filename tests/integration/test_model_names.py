"""Model names as the servers know them, end to end: a server that serves one name (and answers
404 to any other), a worker in front of it, the gateway, and the SDK."""

from __future__ import annotations

import time

import pytest

from pipeline.catalog.store import ModelStore
from pipeline.client import LlmqClient
from pipeline.models import Request, Status, now_ms
from pipeline.simulator.process import SimulatorProcess
from pipeline.worker.backends.factory import make_backend
from tests.integration.gateway.test_gateway import running_gateway
from tests.integration.harness import running_worker

SERVED = "qwen-tiny"


@pytest.fixture
def server():
    with SimulatorProcess("--served-model-name", SERVED) as sim:
        yield sim


def _openai_worker(settings, server):
    settings.worker.backend = "openai"
    settings.worker.openai_base_url = server.base_url
    settings.models.aliases = {"gpt-4o-mini": SERVED}
    return make_backend(settings.worker, settings.models)


def _wait_for_catalog(settings, timeout: float = 30.0):
    store = ModelStore(settings).start()
    try:
        deadline = time.monotonic() + timeout
        while not store.catalog().known(now_ms()):
            assert time.monotonic() < deadline, "no pool published its models"
            time.sleep(0.1)
        return store.catalog()
    finally:
        store.stop()


def test_the_gateway_runs_no_model_on_the_served_one_and_refuses_a_model_nobody_serves(settings, server, tmp_path):
    settings.worker.source = "dispatch"
    backend = _openai_worker(settings, server)
    with running_worker(settings, backend), running_gateway(settings, tmp_path), LlmqClient(settings) as client:
        catalog = _wait_for_catalog(settings)
        assert catalog.names(now_ms()) == [SERVED, "gpt-4o-mini"] and catalog.default(now_ms()) == SERVED
        plain, alias, unknown = (Request.new("acme", "hello"), Request.new("acme", "hi", model="gpt-4o-mini"),
                                 Request.new("acme", "hey", model="gpt-4o"))
        for req in (plain, alias, unknown):
            client.submit(req)
        answers = {r.request_id: client.result(r.request_id, timeout=60) for r in (plain, alias, unknown)}
    assert answers[plain.request_id].status is Status.COMPLETED and answers[plain.request_id].model == SERVED
    # an alias is served by its target, and the answer keeps the name the caller asked for
    assert answers[alias.request_id].status is Status.COMPLETED and answers[alias.request_id].model == "gpt-4o-mini"
    refused = answers[unknown.request_id]
    assert refused.status is Status.REJECTED and refused.reason.startswith("model_not_found: ")
    assert "'gpt-4o'" in refused.reason and SERVED in refused.reason
    assert refused.started_at is None  # refused before it was queued: no worker ran it


def test_without_a_gateway_the_worker_runs_no_model_on_the_served_one_and_fails_an_unlisted_one(settings, server):
    backend = _openai_worker(settings, server)
    with running_worker(settings, backend), LlmqClient(settings) as client:
        plain, unknown = Request.new("acme", "hello"), Request.new("acme", "hey", model="gpt-4o")
        client.submit(plain)
        client.submit(unknown)
        first, second = client.result(plain.request_id, timeout=60), client.result(unknown.request_id, timeout=60)
    assert first.status is Status.COMPLETED and first.model == SERVED
    # the server's list is known, so no call is made for a name it does not serve
    assert second.status is Status.FAILED and second.reason.startswith("model_unavailable")
