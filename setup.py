"""Only the optional C extension lives here; everything else is in pyproject.toml.

``pipeline.serde._native`` is the C twin of the codec pipeline/serde/fastpath.py generates. Without
a C compiler the build skips it (``optional=True``) and llmq runs on the Python code alone, with the
same results.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("pipeline.serde._native", sources=["pipeline/serde/_native.c"], depends=["pipeline/serde/_avro.h"],
                  optional=True, extra_compile_args=["-O2", "-Wall"])
    ]
)
