"""pytest fixtures of a real llama.cpp server on the tiny random model; test modules and
conftests import them (``from tests.llama.fixtures import llama_model, llama_server``)."""

from __future__ import annotations

import pytest

from tests.llama import install
from tests.llama.gguf_model import TinyLlamaShape, write_tiny_llama
from tests.llama.server import LlamaServer


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory):
    try:
        install.ensure(allow_build=False)  # seconds from the cached wheel; the build is make llama's
    except install.InstallError as exc:
        pytest.fail(str(exc), pytrace=False)
    return write_tiny_llama(tmp_path_factory.mktemp("gguf"), seed=7, shape=TinyLlamaShape(context_length=2048))


@pytest.fixture(scope="session")
def llama_server(llama_model, tmp_path_factory):
    server = LlamaServer(llama_model, tmp_path_factory.mktemp("llama-log") / "server.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_llama_server(llama_model, tmp_path):
    """A server of the test's own, for tests that kill it."""
    server = LlamaServer(llama_model, tmp_path / "server.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
