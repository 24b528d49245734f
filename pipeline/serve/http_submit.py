"""``llmq submit --via URL --key-file FILE``: one request through ``llmq serve`` over HTTP.

Waiting: ``POST /v1/completions`` (answered when the answer comes); ``--no-wait``:
``POST /v1/requests`` and the id printed. Errors print OpenAI's error message (the key is never
printed); exit status 0 for an answer, 3 for a refusal or failure, 1 when serve is unreachable.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

from pipeline.models import Priority
from pipeline.tenants.keys import read_key_file


def submit_via(url: str, key_file: str | None, prompt: str, *, priority: Priority, model: str, max_tokens: int,
               timeout_s: float, wait: bool, as_json: bool) -> int:
    if not key_file:
        raise SystemExit("llmq submit: --via needs --key-file FILE (the API key)")
    key = read_key_file(key_file)
    path = "/v1/completions" if wait else "/v1/requests"
    fields = {"model": model} if model else {}  # none: serve's default model
    body = json.dumps({**fields, "prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=body, method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json", "x-llmq-priority": priority.value,
        "x-llmq-timeout-ms": str(int(timeout_s * 1000))})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s + 5) as resp:
            status, doc = resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        status = exc.code
        try:
            doc = json.loads(exc.read())
        except ValueError:
            doc = {"error": {"message": exc.reason}}
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"llmq submit: cannot reach {url}: {reason}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(doc))
    if "error" in doc:
        if not as_json:
            retry = ""
            print(f"HTTP {status}: {doc['error'].get('message')}{retry}")
        return 3
    if not wait:
        if not as_json:
            print(doc["id"])
        return 0
    if not as_json:
        print(f"COMPLETED: {doc['choices'][0]['text']}")
    return 0
