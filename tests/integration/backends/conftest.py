"""Fixtures of the model-server tests: a real llama.cpp server on a tiny random model."""

from tests.llama.fixtures import llama_model, llama_server, own_llama_server  # noqa: F401
