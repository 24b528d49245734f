"""What the wheel carries besides modules: every data file of the packages, the schemas included.

A file that is not a module ships only when pyproject.toml's package-data names it, so a file
added to a package and read at run time would be missing from the wheel alone: these tests fail
first. tests/integration/test_wheel.py builds and runs the wheel itself."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
#: Left out of the wheel on purpose: byte code, and extensions built in place
NOT_SHIPPED = ("*.py", "*.pyc", "*.so")


def _uncovered(package: str, directory: Path) -> list[str]:
    patterns = SETUPTOOLS["package-data"].get(package, ())
    return [f.name for f in sorted(directory.iterdir())
            if f.is_file() and not any(fnmatch.fnmatch(f.name, p) for p in (*NOT_SHIPPED, *patterns))]


def test_the_schemas_ship_from_the_top_level_directory_every_file_as_package_data():
    assert SETUPTOOLS["package-dir"] == {"pipeline._schemas": "schemas"}
    schemas = REPO_ROOT / "schemas"
    assert list(schemas.glob("*.avsc")) and list((schemas / "history").glob("*.avsc"))
    assert _uncovered("pipeline._schemas", schemas) == []
    assert _uncovered("pipeline._schemas.history", schemas / "history") == []
    assert sorted(d.name for d in schemas.iterdir() if d.is_dir() and d.name != "__pycache__") == ["history"]
    setup_py = (REPO_ROOT / "setup.py").read_text()
    assert '"pipeline._schemas", "pipeline._schemas.history"' in setup_py


def test_every_data_file_under_pipeline_is_package_data():
    # e.g. pipeline/broker.py reads pipeline/resources/kafka-pom.xml through importlib.resources
    missing = {}
    for directory in [REPO_ROOT / "pipeline", *(REPO_ROOT / "pipeline").rglob("*")]:
        if directory.is_dir() and directory.name != "__pycache__":
            package = ".".join(directory.relative_to(REPO_ROOT).parts)
            if uncovered := _uncovered(package, directory):
                missing[package] = uncovered
    assert missing == {}, "name them in [tool.setuptools.package-data] of pyproject.toml"
