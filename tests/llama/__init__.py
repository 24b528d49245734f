"""A real llama.cpp server for the test suite: a tiny random-weight GGUF, the pinned
llama-cpp-python server installed from a cached wheel, and a process fixture."""
