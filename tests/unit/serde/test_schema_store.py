"""SchemaStore: loading, consistency checks, the boundedness rule, caching."""

from __future__ import annotations

import copy
import json
import sys
import zipfile
from importlib import resources
from pathlib import Path

import pytest

from pipeline.errors import SerdeError
from pipeline.serde import schema_store
from pipeline.serde.fingerprint import schema_fingerprint
from pipeline.serde.schema_store import (
    SCHEMAS_DIR_ENV,
    SCHEMAS_PACKAGE,
    SchemaLoadError,
    SchemaStore,
    check_schema_bounded,
    prepare_schema,
)
from tests.unit.serde import (
    HISTORY_DIR,
    SCHEMAS_DIR,
    copy_schema_dir,
    history_schema,
    load_json,
    write_schema_dir,
)


@pytest.fixture(scope="module")
def store() -> SchemaStore:
    return SchemaStore.load(SCHEMAS_DIR)


def _record(name: str, fields: list[dict]) -> dict:
    return {"type": "record", "name": name, "namespace": "io.llmq.test", "fields": fields}


# -- loading the real schemas --------------------------------------------------


def test_loads_all_published_revisions(store):
    assert store.names() == ["llm_chunk", "llm_request", "llm_response"]
    assert [r.revision for r in store.revisions("llm_request")] == [1, 2, 3, 4]
    assert [r.revision for r in store.revisions("llm_response")] == [1, 2, 3]
    assert [r.revision for r in store.revisions("llm_chunk")] == [1]
    assert store.current_revision("llm_request").revision == 4
    assert store.current_revision("llm_response").revision == 3
    assert store.current_revision("llm_chunk").revision == 1
    assert store.current_revision("llm_request").fullname == "io.llmq.v1.LLMRequest"
    assert store.current_revision("llm_response").fullname == "io.llmq.v1.LLMResponse"
    assert store.current_revision("llm_chunk").fullname == "io.llmq.v1.LLMChunk"


def test_every_revision_keeps_the_fields_before_it_and_defaults_the_new_ones(store):
    """What keeps io.llmq.v1 compatible both ways: a revision keeps every field of the one
    before, in order and of the same type (an enum may gain symbols at its end), and every
    field it adds has a default."""
    for name in store.names():
        revisions = store.revisions(name)
        for before, after in zip(revisions, revisions[1:]):
            old = {f["name"]: f for f in before.raw["fields"]}
            new = [f["name"] for f in after.raw["fields"]]
            assert [n for n in new if n in old] == list(old), (name, after.revision)
            for f in after.raw["fields"]:
                if f["name"] not in old:
                    assert "default" in f, (name, after.revision, f["name"])
                    continue
                was, now = old[f["name"]]["type"], f["type"]
                if isinstance(was, dict) and was.get("type") == "enum":
                    assert now["symbols"][: len(was["symbols"])] == was["symbols"], (name, f["name"])
                else:
                    assert now == was, (name, after.revision, f["name"])
            assert after.raw["namespace"] == before.raw["namespace"] == "io.llmq.v1"


def test_the_openai_fields_come_last():
    # Appended, so that positional construction of the models with the earlier fields holds.
    request3, request4 = (history_schema("llm_request", n)["fields"] for n in (3, 4))
    assert [f["name"] for f in request4[: len(request3)]] == [f["name"] for f in request3]
    assert [f["name"] for f in request4[len(request3):]] == [
        "messages", "temperature", "top_p", "stop", "user", "stream", "reply_to", "reply_partition"]
    response2, response3 = (history_schema("llm_response", n)["fields"] for n in (2, 3))
    assert [f["name"] for f in response3[len(response2):]] == ["finish_reason", "usage_estimated"]


def test_default_directory_is_the_installed_package_which_is_the_repo_schemas(monkeypatch):
    monkeypatch.delenv(SCHEMAS_DIR_ENV, raising=False)
    # pyproject.toml maps schemas/ to pipeline._schemas: an editable install finds the checkout's
    # one copy through importlib.resources (a wheel carries it; tests/integration/test_wheel.py)
    assert SchemaStore.default_directory() == resources.files(SCHEMAS_PACKAGE) == SCHEMAS_DIR
    assert SchemaStore.load().directory == SCHEMAS_DIR


def test_schemas_load_from_a_package_inside_a_zip(tmp_path, monkeypatch):
    # A Traversable that is no Path (zipimport): listing and reading go through importlib.resources
    archive = tmp_path / "packed.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("packed_llmq_schemas/__init__.py", "")
        for path in sorted(SCHEMAS_DIR.rglob("*.avsc")):
            z.write(path, f"packed_llmq_schemas/{path.relative_to(SCHEMAS_DIR).as_posix()}")
    monkeypatch.syspath_prepend(str(archive))
    monkeypatch.delitem(sys.modules, "packed_llmq_schemas", raising=False)  # undone: the import is dropped
    packed = resources.files("packed_llmq_schemas")
    assert not isinstance(packed, Path)
    loaded, reference = SchemaStore.load(packed), SchemaStore.load(SCHEMAS_DIR)
    assert loaded.names() == reference.names()
    for name in reference.names():
        assert [r.fingerprint for r in loaded.revisions(name)] == [r.fingerprint for r in reference.revisions(name)]
        assert loaded.current_revision(name).fingerprint == reference.current_revision(name).fingerprint


def test_schemas_not_installed_is_a_clear_error_without_paths(monkeypatch):
    monkeypatch.delenv(SCHEMAS_DIR_ENV, raising=False)
    monkeypatch.setattr(schema_store, "SCHEMAS_PACKAGE", "pipeline._no_such_schemas")
    with pytest.raises(SchemaLoadError, match=r"not installed with llmq .*pip install -e \.\).*LLMQ_SCHEMAS_DIR") as err:
        SchemaStore.load()
    assert "/" not in str(err.value)  # it names the package, not where llmq is installed


def test_env_overrides_the_directory(tmp_path, monkeypatch):
    root = copy_schema_dir(tmp_path / "elsewhere")
    monkeypatch.setenv(SCHEMAS_DIR_ENV, str(root))
    assert SchemaStore.default_directory() == root
    assert SchemaStore.load().directory == root


def test_current_is_parsed_without_logical_types(store):
    parsed = store.current("llm_request")
    assert parsed["__fastavro_parsed"]
    assert "logicalType" not in json.dumps({k: v for k, v in parsed.items() if not k.startswith("__")})
    # ...but the published JSON keeps them, and the fingerprint ignores them.
    rev = store.current_revision("llm_request")
    assert "logicalType" in rev.json_text
    assert rev.fingerprint == schema_fingerprint(load_json(SCHEMAS_DIR / "llm_request.avsc"))


def test_writer_for_fingerprint(store):
    for name in store.names():
        for rev in store.revisions(name):
            assert store.writer_for_fingerprint(rev.fingerprint.le_bytes) is rev
            assert store.writer_for_fingerprint(bytearray(rev.fingerprint.le_bytes)) is rev
    assert store.writer_for_fingerprint(b"\x00" * 8) is None


def test_current_unknown_name(store):
    with pytest.raises(KeyError, match="llm_request"):
        store.current("nope")


def test_read_plans_are_cached_and_skip_resolution_for_the_same_schema(store):
    current = store.current_revision("llm_request")
    old = store.revisions("llm_request")[0]
    same = store.read_plan(current, "llm_request")
    assert same.reader is None and same.writer is current.parsed
    assert store.read_plan(current, "llm_request") is same
    evolved = store.read_plan(old, "llm_request")
    assert evolved.writer is old.parsed and evolved.reader is current.parsed
    assert store.read_plan(old, "llm_request") is evolved


# -- consistency of the directory -----------------------------------------------


def test_current_must_equal_newest_revision(tmp_path):
    root = copy_schema_dir(tmp_path / "s")
    schema = load_json(root / "llm_request.avsc")
    schema["fields"].insert(-1, {"name": "extra", "type": "int", "default": 0})
    (root / "llm_request.avsc").write_text(json.dumps(schema))
    with pytest.raises(SchemaLoadError, match="differs from llm_request revision 4"):
        SchemaStore.load(root)
    with pytest.raises(SchemaLoadError, match="equals no published revision"):
        SchemaStore.load(root, allow_older_current=True)


def test_doc_only_edit_of_current_is_also_caught(tmp_path):
    root = copy_schema_dir(tmp_path / "s")
    schema = load_json(root / "llm_request.avsc")
    schema["doc"] = "edited"
    (root / "llm_request.avsc").write_text(json.dumps(schema))
    with pytest.raises(SchemaLoadError):
        SchemaStore.load(root)


def test_older_current_needs_opt_in(tmp_path):
    root = write_schema_dir(
        tmp_path / "s",
        history={
            "llm_request": [history_schema("llm_request", 1), history_schema("llm_request", 2)],
            "llm_response": [history_schema("llm_response", 1)],
        },
        current={"llm_request": history_schema("llm_request", 1), "llm_response": history_schema("llm_response", 1)},
    )
    with pytest.raises(SchemaLoadError, match="newest published revision"):
        SchemaStore.load(root)
    store = SchemaStore.load(root, allow_older_current=True)
    assert store.current_revision("llm_request").revision == 1
    assert len(store.revisions("llm_request")) == 2


def test_reformatting_current_is_fine(tmp_path):
    root = copy_schema_dir(tmp_path / "s")
    schema = load_json(root / "llm_request.avsc")
    (root / "llm_request.avsc").write_text(json.dumps(schema, separators=(",", ":")))
    assert SchemaStore.load(root).current_revision("llm_request").revision == 4


def test_revisions_must_not_have_gaps(tmp_path):
    root = copy_schema_dir(tmp_path / "s")
    (root / "history" / "llm_request.2.avsc").rename(root / "history" / "llm_request.4.avsc")
    with pytest.raises(SchemaLoadError, match="without gaps"):
        SchemaStore.load(root)


def test_current_needs_a_published_revision(tmp_path):
    root = copy_schema_dir(tmp_path / "s")
    for old in (root / "history").glob("llm_response.*.avsc"):
        old.unlink()
    with pytest.raises(SchemaLoadError, match="no published revision"):
        SchemaStore.load(root)


def test_history_file_names_are_checked(tmp_path):
    root = copy_schema_dir(tmp_path / "s")
    (root / "history" / "llm_request.v3.avsc").write_text("{}")
    with pytest.raises(SchemaLoadError, match="<name>.<revision>.avsc"):
        SchemaStore.load(root)


def test_revisions_must_name_the_same_record(tmp_path):
    root = copy_schema_dir(tmp_path / "s")
    schema = load_json(root / "history" / "llm_request.1.avsc")
    schema["name"] = "OtherRequest"
    (root / "history" / "llm_request.1.avsc").write_text(json.dumps(schema))
    with pytest.raises(SchemaLoadError, match="different records"):
        SchemaStore.load(root)


def test_missing_history_and_bad_json(tmp_path):
    with pytest.raises(SchemaLoadError, match="history"):
        SchemaStore.load(tmp_path)
    root = copy_schema_dir(tmp_path / "s")
    (root / "history" / "llm_response.1.avsc").write_text("{not json")
    with pytest.raises(SchemaLoadError, match="not valid JSON"):
        SchemaStore.load(root)


def test_invalid_avro_is_rejected(tmp_path):
    bad = _record("R", [{"name": "a", "type": "no_such_type"}])
    with pytest.raises(SchemaLoadError, match="invalid Avro schema"):
        prepare_schema(bad, name="r", revision=1, source="test")
    with pytest.raises(SchemaLoadError, match="must be a record"):
        prepare_schema({"type": "array", "items": "int"}, name="r", revision=1, source="test")


def test_errors_are_serde_errors():
    assert issubclass(SchemaLoadError, SerdeError)


# -- every collection item must consume bytes -----------------------------------

ZERO_BYTE_ITEMS = [
    "null",
    {"type": "record", "name": "Empty", "fields": []},
    {"type": "record", "name": "Nulls", "fields": [{"name": "a", "type": "null"}]},
    {"type": "fixed", "name": "Nothing", "size": 0},
]


@pytest.mark.parametrize("items", ZERO_BYTE_ITEMS, ids=["null", "empty-record", "null-record", "fixed0"])
def test_arrays_of_zero_byte_items_are_rejected(items):
    schema = _record("R", [{"name": "xs", "type": {"type": "array", "items": items}}])
    with pytest.raises(SchemaLoadError, match="zero bytes"):
        check_schema_bounded(schema)
    with pytest.raises(SchemaLoadError, match="zero bytes"):
        prepare_schema(schema, name="r", revision=1, source="test")


def test_zero_byte_items_are_found_anywhere():
    named_later = _record(
        "R",
        [
            {"name": "e", "type": {"type": "record", "name": "E", "fields": []}},
            {"name": "u", "type": ["null", {"type": "map", "values": {"type": "array", "items": "E"}}]},
        ],
    )
    with pytest.raises(SchemaLoadError, match=r"\.u<1>\{\}"):
        check_schema_bounded(named_later)


@pytest.mark.parametrize(
    "items",
    [
        "boolean",
        "int",
        "string",
        ["null", "string"],  # the branch index takes a byte
        {"type": "fixed", "name": "One", "size": 1},
        {"type": "record", "name": "P", "fields": [{"name": "n", "type": "null"}, {"name": "b", "type": "boolean"}]},
        {"type": "map", "values": "null"},
        {"type": "array", "items": "int"},
        {"type": "enum", "name": "E", "symbols": ["A"]},
    ],
)
def test_arrays_of_byte_consuming_items_are_accepted(items):
    schema = _record("R", [{"name": "xs", "type": {"type": "array", "items": items}}])
    check_schema_bounded(schema)
    prepare_schema(schema, name="r", revision=1, source="test")


def test_maps_always_pass_because_keys_take_a_byte():
    schema = _record("R", [{"name": "m", "type": {"type": "map", "values": "null"}}])
    assert check_schema_bounded(schema) == 1


def test_recursive_types_are_rejected():
    linked = {
        "type": "record",
        "name": "Node",
        "fields": [{"name": "value", "type": "int"}, {"name": "next", "type": ["null", "Node"]}],
    }
    with pytest.raises(SchemaLoadError, match="recursive"):
        check_schema_bounded(linked)


def test_namespaced_references_resolve():
    schema = {
        "type": "record",
        "name": "Outer",
        "namespace": "a.b",
        "fields": [
            {"name": "f", "type": {"type": "fixed", "name": "F", "size": 0}},
            {"name": "g", "type": {"type": "array", "items": "a.b.F"}},
        ],
    }
    with pytest.raises(SchemaLoadError, match="zero bytes"):
        check_schema_bounded(schema)
    ok = copy.deepcopy(schema)
    ok["fields"][0]["type"]["size"] = 2
    assert check_schema_bounded(ok) == 2 + 1


def test_store_refuses_to_load_an_unbounded_schema(tmp_path):
    bad = _record("LLMRequest", [{"name": "xs", "type": {"type": "array", "items": "null"}}])
    root = write_schema_dir(tmp_path / "s", history={"llm_request": [bad]}, current={"llm_request": bad})
    with pytest.raises(SchemaLoadError, match="zero bytes"):
        SchemaStore.load(root)


def test_minimum_sizes_of_the_real_schemas(store):
    # Lower bounds used by the guards: every field takes at least one byte.
    assert check_schema_bounded(load_json(SCHEMAS_DIR / "llm_request.avsc")) == 25
    assert check_schema_bounded(load_json(SCHEMAS_DIR / "llm_response.avsc")) == 22
    assert check_schema_bounded(load_json(SCHEMAS_DIR / "llm_chunk.avsc")) == 7


def test_every_published_revision_still_resolves(store):
    """Bytes written with any revision ever published name a schema the store still has."""
    for name, count in (("llm_request", 4), ("llm_response", 3), ("llm_chunk", 1)):
        for revision in range(1, count + 1):
            published = load_json(HISTORY_DIR / f"{name}.{revision}.avsc")
            fp = schema_fingerprint(published).le_bytes
            found = store.writer_for_fingerprint(fp)
            assert found is not None and (found.name, found.revision) == (name, revision)
    assert len({r.fingerprint.le_bytes for n in store.names() for r in store.revisions(n)}) == 8
