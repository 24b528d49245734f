"""``llmq batch`` as a user runs it, against the real stack: the broker, a gateway, a worker and
``llmq serve``; the command itself never reaches Kafka."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.test_batch_api import _line, _pipeline
from tests.integration.test_serve import key_of, running_serve

pytestmark = pytest.mark.slow

LINES = 20


def test_llmq_batch_submit_waits_saves_the_results_and_status_and_results_agree(bootstrap, tmp_path):
    key_file = tmp_path / "acme.key"
    key_file.write_text(key_of("acme") + "\n")
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(_line(i)) + "\n" for i in range(LINES)))
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    with _pipeline(bootstrap, tmp_path) as (s, registry, env, _), \
            running_serve(s, tmp_path, registry, reply_partitions="0", env=env) as (url, _, log):

        def llmq(*argv: str) -> subprocess.CompletedProcess:
            done = subprocess.run([sys.executable, "-m", "pipeline.cli", "batch", *argv, "--via", url,
                                   "--key-file", str(key_file)], capture_output=True, text=True, timeout=50,
                                  cwd=tmp_path, env={**os.environ, "LLMQ_BOOTSTRAP": "127.0.0.1:1"})
            assert key_of("acme") not in done.stdout + done.stderr
            return done

        submitted = llmq("submit", str(requests), "--wait", "--output", str(out), "--errors", str(err),
                         "--metadata", "job=cli-test", "--priority", "low")
        assert submitted.returncode == 0, (submitted.stdout, submitted.stderr, log.read_text()[-3000:])
        batch_id, summary = submitted.stdout.splitlines()
        assert summary.startswith(f"{batch_id} completed: {LINES} completed, 0 failed of {LINES}; output file-")
        assert f"answered {LINES}/{LINES}" in submitted.stderr
        answered = [json.loads(x) for x in out.read_text().splitlines()]
        assert sorted(a["custom_id"] for a in answered) == sorted(f"req-{i}" for i in range(LINES))
        assert all(a["response"]["status_code"] == 200 for a in answered)
        assert err.read_text() == ""

        status = llmq("status", batch_id, "--json")
        assert status.returncode == 0, status.stderr
        batch = json.loads(status.stdout)
        assert batch["status"] == "completed" and batch["metadata"] == {"job": "cli-test", "priority": "LOW"}
        assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
        text = llmq("status", batch_id).stdout
        assert text.startswith(f"{batch_id}: completed\n") and batch["output_file_id"] in text

        results = llmq("results", batch_id)
        assert results.returncode == 0 and results.stdout == out.read_text()
