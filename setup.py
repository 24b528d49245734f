"""Only what pyproject.toml cannot say: the package list (everything else is in pyproject.toml).

Every package under pipeline/ as found, plus the top-level schemas/ directory as pipeline._schemas
(pyproject.toml's package-dir maps it; its package-data takes the .avsc files)."""

from setuptools import find_namespace_packages, setup

setup(packages=[*find_namespace_packages(include=["pipeline", "pipeline.*"], exclude=["*.__pycache__"]),
                "pipeline._schemas", "pipeline._schemas.history"])
