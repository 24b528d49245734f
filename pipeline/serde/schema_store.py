"""The published Avro schemas: every revision ever written, indexed by fingerprint.

Layout of the schema directory (the schemas installed with llmq by default, or the
directory named by the environment variable ``LLMQ_SCHEMAS_DIR``)::

    schemas/
      llm_request.avsc            the current revision (what producers write)
      llm_response.avsc
      llm_chunk.avsc              streamed pieces of answers (optional: see the codec)
      history/llm_request.1.avsc  every revision ever published, numbered from 1
      history/llm_request.2.avsc
      ...

The repository's top-level ``schemas/`` is the one copy: setup.py and pyproject.toml ship it as the
package ``pipeline._schemas``, found through :mod:`importlib.resources`, so a wheel
installed anywhere and an editable checkout read the same files.

A record written with any published revision can be decoded: its single-object header
names the writer revision by fingerprint, and fastavro resolves it to the current
(reader) revision.

Every schema is checked when loaded:

* it must parse with fastavro and be a record;
* every array item must take at least one byte to encode (an array of ``null``, of an
  empty record or of a zero-size ``fixed`` is rejected). Map entries always take at
  least one byte (the key's length), so maps always pass. With this rule a message of
  N bytes can never make the decoder loop more than about N times, so the codec's
  size cap really bounds decoding work (otherwise ten bytes claiming 2**62 nulls
  would keep fastavro busy, allocating, forever);
* recursive types are rejected: decoding them nests as deep as the message says, and
  fastavro's compiled reader recurses on the C stack.

Parsed schemas have their ``logicalType`` annotations removed, so fastavro reads and
writes timestamps as plain ``int`` milliseconds and UUIDs as ``str`` (logical types do
not affect the binary encoding or the fingerprint).

Errors name schemas by name and revision (``llm_request revision 3``), never by their
path on this machine: their messages reach logs and dead-letter headers other people read.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Iterable, Mapping

import fastavro
from fastavro.schema import SchemaParseException, UnknownType

from pipeline.errors import SerdeError
from pipeline.serde.fingerprint import Fingerprint, canonical_fingerprint, canonical_form

__all__ = [
    "SCHEMAS_DIR_ENV",
    "SchemaLoadError",
    "SchemaRevision",
    "ReadPlan",
    "SchemaStore",
    "prepare_schema",
    "check_schema_bounded",
]

#: Environment variable that overrides the default schema directory.
SCHEMAS_DIR_ENV = "LLMQ_SCHEMAS_DIR"

#: The package the schemas ship in (pyproject.toml maps the top-level schemas/ to it).
SCHEMAS_PACKAGE = "pipeline._schemas"

_HISTORY_FILE = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)\.(?P<revision>[0-9]+)\.avsc$")
_CURRENT_FILE = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)\.avsc$")

# Minimum encoded size, in bytes, of each primitive type.
_PRIMITIVE_MIN_BYTES = {
    "null": 0,
    "boolean": 1,
    "int": 1,
    "long": 1,
    "float": 4,
    "double": 8,
    "bytes": 1,
    "string": 1,
}


class SchemaLoadError(SerdeError):
    """A schema file or registry schema is missing, malformed or not allowed."""


@dataclass(frozen=True, slots=True, eq=False)
class SchemaRevision:
    """One schema as published, with everything the codec needs precomputed.

    ``raw`` and ``json_text`` are the schema as published (docs and logical types
    included); ``parsed`` is the fastavro-parsed form without logical types. ``source``
    names where it came from for messages (``llm_request revision 3``, ``registry schema
    id 7``), never a file path.
    """

    name: str
    revision: int | None
    fullname: str
    raw: Any
    json_text: str
    parsed: dict
    canonical: str
    fingerprint: Fingerprint
    source: str


@dataclass(frozen=True, slots=True, eq=False)
class ReadPlan:
    """How to read one writer schema into one reader schema.

    ``reader`` is ``None`` when writer and reader are the same schema (same
    fingerprint), which spares fastavro the schema-resolution work.
    """

    writer: dict
    reader: dict | None
    writer_fullname: str
    writer_source: str


def _strip_logical_types(schema: Any) -> Any:
    """A copy of ``schema`` without ``logicalType`` keys (default values untouched)."""
    if isinstance(schema, list):
        return [_strip_logical_types(branch) for branch in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "logicalType":
            continue
        if key in ("type", "items", "values"):
            value = _strip_logical_types(value)
        elif key == "fields" and isinstance(value, list):
            value = [
                {k: (_strip_logical_types(v) if k == "type" else v) for k, v in f.items() if k != "logicalType"}
                if isinstance(f, dict)
                else f
                for f in value
            ]
        out[key] = value
    return out


class _BoundCheck:
    """Computes the minimum encoded size of a (fastavro-validated) schema.

    Raises :class:`SchemaLoadError` for arrays whose items may take zero bytes and for
    recursive named types.
    """

    def __init__(self, source: str):
        self.source = source
        # fullname -> minimum encoded size; None while that record is being walked.
        self.named: dict[str, int | None] = {}

    @staticmethod
    def _fullname(schema: dict, namespace: str) -> tuple[str, str]:
        name = schema["name"]
        if "." in name:
            return name, name.rsplit(".", 1)[0]
        ns = schema.get("namespace", namespace) or ""
        return (f"{ns}.{name}" if ns else name), ns

    def _reference(self, name: str, namespace: str, path: str) -> int:
        candidates = [name] if "." in name else ([f"{namespace}.{name}", name] if namespace else [name])
        for candidate in candidates:
            if candidate in self.named:
                size = self.named[candidate]
                if size is None:
                    raise SchemaLoadError(
                        f"{self.source}: {path}: recursive type {candidate} is not allowed "
                        "(its nesting depth would be bounded only by the message size)"
                    )
                return size
        raise SchemaLoadError(f"{self.source}: {path}: unknown type {name!r}")

    def min_bytes(self, schema: Any, namespace: str, path: str) -> int:
        if isinstance(schema, str):
            size = _PRIMITIVE_MIN_BYTES.get(schema)
            if size is not None:
                return size
            return self._reference(schema, namespace, path)
        if isinstance(schema, list):
            for i, branch in enumerate(schema):
                self.min_bytes(branch, namespace, f"{path}<{i}>")
            return 1  # the branch index
        if not isinstance(schema, dict):
            raise SchemaLoadError(f"{self.source}: {path}: not a schema: {schema!r}")
        kind = schema.get("type")
        if kind in ("record", "error"):
            fullname, ns = self._fullname(schema, namespace)
            self.named[fullname] = None
            total = 0
            for f in schema.get("fields", ()):
                total += self.min_bytes(f["type"], ns, f"{path}.{f['name']}")
            self.named[fullname] = total
            return total
        if kind == "enum":
            fullname, _ = self._fullname(schema, namespace)
            self.named[fullname] = 1
            return 1
        if kind == "fixed":
            fullname, _ = self._fullname(schema, namespace)
            size = int(schema["size"])
            self.named[fullname] = size
            return size
        if kind == "array":
            items = self.min_bytes(schema["items"], namespace, f"{path}[]")
            if items < 1:
                raise SchemaLoadError(
                    f"{self.source}: {path}: array items can be encoded in zero bytes, so a few "
                    "bytes could claim billions of them; use items that take at least one byte"
                )
            return 1  # the terminating zero block count
        if kind == "map":
            # Every entry carries its key (a string, at least one byte), so a map is
            # bounded whatever its values.
            self.min_bytes(schema["values"], namespace, f"{path}{{}}")
            return 1
        return self.min_bytes(kind, namespace, path)


def check_schema_bounded(schema: Any, source: str = "schema") -> int:
    """Raise :class:`SchemaLoadError` unless every array item takes at least one byte
    and no type is recursive; returns the schema's minimum encoded size in bytes."""
    return _BoundCheck(source).min_bytes(schema, "", "")


def prepare_schema(raw: Any, *, name: str, revision: int | None, source: str, json_text: str | None = None) -> SchemaRevision:
    """Validate and parse one record schema (a JSON-decoded object).

    Raises :class:`SchemaLoadError` if fastavro rejects it, if it is not a record, or
    if it fails :func:`check_schema_bounded`.
    """
    if not isinstance(raw, dict) or raw.get("type") not in ("record", "error"):
        raise SchemaLoadError(f"{source}: the top-level schema must be a record")
    try:
        parsed = fastavro.parse_schema(_strip_logical_types(raw))
        canonical = canonical_form(raw)
    except (SchemaParseException, UnknownType) as exc:
        raise SchemaLoadError(f"{source}: invalid Avro schema: {exc}") from exc
    except Exception as exc:  # registry schemas are untrusted: any failure is a refusal
        raise SchemaLoadError(f"{source}: invalid Avro schema: {type(exc).__name__}: {exc}") from exc
    try:
        check_schema_bounded(raw, source)
    except SchemaLoadError:
        raise
    except Exception as exc:
        raise SchemaLoadError(f"{source}: cannot check schema: {type(exc).__name__}: {exc}") from exc
    return SchemaRevision(
        name=name,
        revision=revision,
        fullname=parsed["name"],
        raw=raw,
        json_text=json_text if json_text is not None else json.dumps(raw),
        parsed=parsed,
        canonical=canonical,
        fingerprint=canonical_fingerprint(canonical),
        source=source,
    )


def _label(name: str, revision: int | None) -> str:
    return f"{name} revision {revision}" if revision is not None else f"the current {name} schema"


def _read_schema_file(path: Traversable, name: str, revision: int | None) -> SchemaRevision:
    label = _label(name, revision)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:  # its str() names the path
        raise SchemaLoadError(f"{label}: cannot read: {exc.strerror or type(exc).__name__}") from None
    except UnicodeDecodeError as exc:
        raise SchemaLoadError(f"{label}: not UTF-8: {exc.reason}") from None
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise SchemaLoadError(f"{label}: not valid JSON: {exc}") from None
    return prepare_schema(raw, name=name, revision=revision, source=label, json_text=text)


class SchemaStore:
    """Every published revision of every schema, plus the current one of each name.

    Names are the file stems (``llm_request``, ``llm_response``, ``llm_chunk``).
    """

    def __init__(self, revisions: Iterable[SchemaRevision], current: Mapping[str, SchemaRevision],
                 directory: Traversable | None = None):
        self.directory = directory
        self._by_name: dict[str, list[SchemaRevision]] = {}
        self._by_fingerprint: dict[bytes, SchemaRevision] = {}
        for rev in revisions:
            self._by_name.setdefault(rev.name, []).append(rev)
            # Revisions that differ only in docs or defaults share a fingerprint; as
            # writer schemas they are interchangeable, so the first one wins.
            self._by_fingerprint.setdefault(rev.fingerprint.le_bytes, rev)
        for revs in self._by_name.values():
            revs.sort(key=lambda r: r.revision or 0)
        self._current = dict(current)
        for name, rev in self._current.items():
            self._by_fingerprint.setdefault(rev.fingerprint.le_bytes, rev)
        self._plans: dict[tuple[bytes, str], ReadPlan] = {}
        self._lock = threading.Lock()

    # -- loading ---------------------------------------------------------------

    @staticmethod
    def default_directory() -> Traversable:
        """``$LLMQ_SCHEMAS_DIR`` if set, else the schemas installed with llmq (package
        ``pipeline._schemas``: a plain directory, a :class:`~pathlib.Path`, unless llmq
        is imported from a zip)."""
        env = os.environ.get(SCHEMAS_DIR_ENV)
        if env:
            return Path(env)
        try:
            return resources.files(SCHEMAS_PACKAGE)
        except ModuleNotFoundError:
            # An editable install made before the schemas became a package, or a checkout put on
            # sys.path without installing it.
            raise SchemaLoadError(
                f"the schemas are not installed with llmq (no package {SCHEMAS_PACKAGE}): reinstall llmq "
                f"(in a checkout: pip install -e .), or name the schema directory in ${SCHEMAS_DIR_ENV}"
            ) from None

    @classmethod
    def load(cls, directory: str | os.PathLike[str] | Traversable | None = None, *,
             allow_older_current: bool = False) -> SchemaStore:
        """Load ``directory`` (default: :meth:`default_directory`).

        Each current ``<name>.avsc`` must be identical (as JSON) to the newest
        ``history/<name>.<n>.avsc``: a changed schema has to be published as a new
        revision before producers may write it. ``allow_older_current=True`` accepts a
        current schema equal to any published revision (a reader pinned to an older
        revision, as an older deployment would be).
        """
        if directory is None:
            root = cls.default_directory()
        elif isinstance(directory, (str, os.PathLike)):
            root = Path(directory)
        else:
            root = directory
        history_dir = root / "history"
        if not history_dir.is_dir():
            raise SchemaLoadError(
                f"the schema directory has no history directory (the schema directory is ${SCHEMAS_DIR_ENV}, "
                "else the schemas installed with llmq)"
            )

        found: dict[str, dict[int, Traversable]] = {}
        try:
            listing = sorted(history_dir.iterdir(), key=lambda p: p.name)
        except OSError as exc:  # its str() names the path
            raise SchemaLoadError(f"cannot list the history directory: {exc.strerror or type(exc).__name__}") from None
        for path in listing:
            if not path.name.endswith(".avsc"):
                continue
            match = _HISTORY_FILE.match(path.name)
            if not match:
                raise SchemaLoadError(f"history file {path.name!r}: history files must be named <name>.<revision>.avsc")
            found.setdefault(match["name"], {})[int(match["revision"])] = path

        revisions: list[SchemaRevision] = []
        newest: dict[str, SchemaRevision] = {}
        by_name: dict[str, list[SchemaRevision]] = {}
        for name, paths in sorted(found.items()):
            numbers = sorted(paths)
            if numbers != list(range(1, len(numbers) + 1)):
                raise SchemaLoadError(f"revisions of {name} must be numbered 1..n without gaps, found {numbers}")
            revs = [_read_schema_file(paths[n], name, n) for n in numbers]
            fullnames = {r.fullname for r in revs}
            if len(fullnames) != 1:
                raise SchemaLoadError(f"revisions of {name} name different records: {sorted(fullnames)}")
            revisions.extend(revs)
            by_name[name] = revs
            newest[name] = revs[-1]

        current: dict[str, SchemaRevision] = {}
        # Traversable has no glob(); the current schemas are the .avsc files beside history/.
        for path in sorted((p for p in root.iterdir() if p.name.endswith(".avsc") and p.is_file()),
                           key=lambda p: p.name):
            match = _CURRENT_FILE.match(path.name)
            if not match:
                raise SchemaLoadError(f"schema file {path.name!r}: current schema files must be named <name>.avsc")
            name = match["name"]
            if name not in by_name:
                raise SchemaLoadError(f"{_label(name, None)} has no published revision (publish it as {name} revision 1)")
            cur = _read_schema_file(path, name, None)
            if cur.raw == newest[name].raw:
                current[name] = by_name[name][-1]
                continue
            if allow_older_current:
                same = [r for r in by_name[name] if r.raw == cur.raw]
                if same:
                    current[name] = same[-1]
                    continue
                raise SchemaLoadError(f"{_label(name, None)} equals no published revision")
            following = newest[name].revision + 1
            raise SchemaLoadError(
                f"{_label(name, None)} differs from {newest[name].source}, the newest published revision; "
                f"publish the change as {name} revision {following} or restore it"
            )
        return cls(revisions, current, directory=root)

    # -- look-ups --------------------------------------------------------------

    def names(self) -> list[str]:
        """Names that have a current schema."""
        return sorted(self._current)

    def current_revision(self, name: str) -> SchemaRevision:
        """The current :class:`SchemaRevision` of ``name`` (``KeyError`` if none)."""
        try:
            return self._current[name]
        except KeyError:
            raise KeyError(f"no current schema named {name!r} (have: {', '.join(self.names())})") from None

    def current(self, name: str) -> dict:
        """The parsed current (reader) schema of ``name``."""
        return self.current_revision(name).parsed

    def revisions(self, name: str) -> list[SchemaRevision]:
        """Every published revision of ``name``, oldest first."""
        return list(self._by_name.get(name, ()))

    def writer_for_fingerprint(self, fp: bytes) -> SchemaRevision | None:
        """The published schema whose CRC-64-AVRO fingerprint (8 LE bytes) is ``fp``."""
        return self._by_fingerprint.get(bytes(fp))

    def read_plan(self, writer: SchemaRevision, name: str) -> ReadPlan:
        """The cached :class:`ReadPlan` from ``writer`` to the current schema of ``name``.

        Keyed by the writer's fingerprint, so writer schemas fetched from a registry
        share plans with the identical published ones.
        """
        key = (writer.fingerprint.le_bytes, name)
        plan = self._plans.get(key)
        if plan is None:
            reader = self.current_revision(name)
            same = reader.fingerprint.le_bytes == writer.fingerprint.le_bytes
            plan = ReadPlan(
                writer=writer.parsed,
                reader=None if same else reader.parsed,
                writer_fullname=writer.fullname,
                # Travels into dead-letter headers: name the revision, not a server path.
                writer_source=(f"{writer.fullname} revision {writer.revision}" if writer.revision is not None
                               else f"{writer.fullname} (registry)"),
            )
            with self._lock:
                plan = self._plans.setdefault(key, plan)
        return plan
