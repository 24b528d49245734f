"""The gateway's /healthz and /readyz through a real broker: 200 once it runs."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.gateway.test_gateway import GATEWAY_TOML, running_gateway
from tests.integration.harness import free_port

pytestmark = pytest.mark.integration


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_for(url: str, status: int = 200, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        code, doc = get(url)
        if code == status:
            return doc
        assert time.monotonic() < deadline, (code, doc)
        time.sleep(0.3)


def test_gateway_answers_healthz_and_readyz(settings, tmp_path):
    port = free_port()
    toml = GATEWAY_TOML.format(requests=1000).replace("web_port = 0", f"web_port = {port}")
    with running_gateway(settings, tmp_path, toml=toml):
        base = f"http://127.0.0.1:{port}"
        doc = wait_for(f"{base}/healthz")
        assert doc["status"] == "ok" and "progress" in doc["checks"]
        doc = wait_for(f"{base}/readyz")
        assert doc["status"] == "ok" and {"started", "recovery", "consumer"} <= set(doc["checks"])
