"""Unit tests of pipeline.serde, and the helpers they share."""

from __future__ import annotations

import copy
import io
import json
import shutil
from pathlib import Path
from typing import Any

import fastavro

from pipeline.models import Chunk, Priority, Request, Response, Status, TaskTier
from pipeline.testing import zigzag  # noqa: F401 (the serde tests take it from here)

REPO_ROOT = Path(__file__).resolve().parents[3]
SCHEMAS_DIR = REPO_ROOT / "schemas"
HISTORY_DIR = SCHEMAS_DIR / "history"


def load_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def history_schema(name: str, revision: int) -> dict:
    """A published revision, as JSON (a fresh copy each call)."""
    return load_json(HISTORY_DIR / f"{name}.{revision}.avsc")


def avro_body(schema: Any, record: Any) -> bytes:
    """Avro binary body of ``record`` written by fastavro itself with ``schema``."""
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(copy.deepcopy(schema)), record)
    return buf.getvalue()


def write_schema_dir(root: Path, history: dict[str, list[dict]], current: dict[str, dict]) -> Path:
    """Lay out a schema directory: ``history[name]`` holds revisions 1..n."""
    (root / "history").mkdir(parents=True, exist_ok=True)
    for name, revisions in history.items():
        for number, schema in enumerate(revisions, start=1):
            (root / "history" / f"{name}.{number}.avsc").write_text(json.dumps(schema, indent=2))
    for name, schema in current.items():
        (root / f"{name}.avsc").write_text(json.dumps(schema, indent=2))
    return root


def pinned_schema_dir(root: Path, **current_revision: int) -> Path:
    """Every published revision, with the current schema of each name pinned to an older one.

    ``pinned_schema_dir(root, llm_request=2)`` is what a consumer deployed before revision 3
    would run, once it has been given the newer history (load it with
    ``allow_older_current=True``); names not given stay at their newest revision.
    """
    root = copy_schema_dir(root)
    for name, revision in current_revision.items():
        shutil.copyfile(root / "history" / f"{name}.{revision}.avsc", root / f"{name}.avsc")
    return root


def copy_schema_dir(root: Path) -> Path:
    """A copy of the repository's schemas/ at ``root`` (which must not exist)."""
    shutil.copytree(SCHEMAS_DIR, root)
    return root


def full_request(**overrides: Any) -> Request:
    """A request with every optional field set to a non-default value."""
    fields: dict[str, Any] = dict(
        request_id="0b6f8a3c-2f1e-4d2a-9c53-6d7e8f901234",
        tenant_id="tenant-42",
        priority=Priority.HIGH,
        prompt="Explain the Avro single-object encoding. ünïcødé ✓ 🚀",
        model="sim-large",
        max_tokens=512,
        created_at=1_700_000_000_123,
        timeout_ms=30_000,
        user_tier="gold",
        task_tier=TaskTier.REALTIME,
        allow_degrade=True,
        notify_queued=True,
        trace_id="trace-abc-123",
        metadata={"source": "cli", "lang": "en", "ключ": "значение"},
        admitted_at=1_700_000_000_150,
        effective_priority=Priority.CRITICAL,
        degraded_from="sim-huge ✓",
        messages=[{"role": "system", "content": "Be brief. ✓"},
                  {"role": "user", "content": "Explain Avro.", "name": "alice"}],
        temperature=0.7,
        top_p=0.25,
        stop=["\n\n", "END"],
        user="end-user-7",
        stream=True,
        reply_to="llm.replies.gw-1",
        reply_partition=2,
    )
    fields.update(overrides)
    return Request(**fields)


def minimal_request(**overrides: Any) -> Request:
    """A request with every optional field left at its default."""
    fields: dict[str, Any] = dict(
        request_id="1c7e9b4d-3a2f-4e3b-8d64-7e8f9a012345",
        tenant_id="t",
        priority=Priority.NORMAL,
        prompt="",
        model="sim-small",
        max_tokens=0,
        created_at=0,
        timeout_ms=0,
    )
    fields.update(overrides)
    return Request(**fields)


def full_response(**overrides: Any) -> Response:
    """A response with every optional field set."""
    fields: dict[str, Any] = dict(
        request_id="0b6f8a3c-2f1e-4d2a-9c53-6d7e8f901234",
        tenant_id="tenant-42",
        status=Status.COMPLETED,
        reason="ok: served",
        output="Avro single-object encoding is C3 01 + fingerprint + body. ✓",
        prompt_tokens=17,
        completion_tokens=250,
        model="sim-small",
        degraded=True,
        requested_priority=Priority.HIGH,
        served_priority=Priority.LOW,
        created_at=1_700_000_000_123,
        admitted_at=1_700_000_000_200,
        started_at=1_700_000_000_300,
        finished_at=1_700_000_001_000,
        worker_id="worker-3",
        retry_after_ms=1500,
        metadata={"trace_id": "trace-abc-123"},
        queue_position=12,
        eta_ms=4_200,
        finish_reason="length",
        usage_estimated=True,
    )
    fields.update(overrides)
    return Response(**fields)


def minimal_response(**overrides: Any) -> Response:
    """A response with every optional field left at its default."""
    fields: dict[str, Any] = dict(
        request_id="1c7e9b4d-3a2f-4e3b-8d64-7e8f9a012345",
        tenant_id="t",
        status=Status.REJECTED,
        requested_priority=Priority.BACKGROUND,
        created_at=0,
        finished_at=0,
    )
    fields.update(overrides)
    return Response(**fields)


def full_chunk(**overrides: Any) -> Chunk:
    """A chunk with every optional field set."""
    fields: dict[str, Any] = dict(
        request_id="0b6f8a3c-2f1e-4d2a-9c53-6d7e8f901234",
        tenant_id="tenant-42",
        seq=41,
        delta=" single-object ✓",
        finish_reason="stop",
        emitted_at=1_700_000_000_900,
        worker_id="worker-3",
    )
    fields.update(overrides)
    return Chunk(**fields)


def minimal_chunk(**overrides: Any) -> Chunk:
    """A chunk with every optional field left at its default."""
    fields: dict[str, Any] = dict(
        request_id="1c7e9b4d-3a2f-4e3b-8d64-7e8f9a012345", tenant_id="t", seq=0, delta="", emitted_at=0
    )
    fields.update(overrides)
    return Chunk(**fields)
