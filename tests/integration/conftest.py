"""Integration fixtures: one real Apache Kafka broker per session, unique topics per test.

The broker is the project's own (`pipeline.broker.LocalBroker`), on a free port with a
temporary data dir, so it never collides with a broker a developer already runs. Set
LLMQ_TEST_BOOTSTRAP to reuse a running broker instead.
"""

from __future__ import annotations

import os

import pytest

from pipeline.broker import LocalBroker
from pipeline.config import Settings
from pipeline.topics import create_pipeline_topics
from tests.integration.harness import free_port, make_settings


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def bootstrap(tmp_path_factory) -> str:
    external = os.environ.get("LLMQ_TEST_BOOTSTRAP")
    if external:
        yield external
        return
    broker = LocalBroker(free_port(), tmp_path_factory.mktemp("kafka"), heap="512m", progress=print)
    broker.up()
    try:
        yield broker.bootstrap
    finally:
        broker.down()


@pytest.fixture
def settings(bootstrap) -> Settings:
    s = make_settings(bootstrap)
    create_pipeline_topics(s)
    return s
