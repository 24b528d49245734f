"""Only the optional C extension lives here; everything else is in pyproject.toml.

``pipeline.serde._native`` is the C twin of the codec pipeline/serde/fastpath.py generates;
``pipeline.worker._lane`` is the worker's fast lane (pipeline/worker/fastlane.py);
``pipeline.gateway._admit`` the gateway's admission lane (pipeline/gateway/admitlane.py). Without a
C compiler the build skips them (``optional=True``) and llmq runs on the Python code alone,
with the same results.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pipeline.serde._native",
            sources=["pipeline/serde/_native.c"],
            depends=["pipeline/serde/_avro.h"],
            optional=True,
            extra_compile_args=["-O2", "-Wall"],
        ),
        Extension(
            "pipeline.worker._lane",
            sources=["pipeline/worker/_lane.c"],
            depends=["pipeline/serde/_avro.h", "pipeline/serde/_request.h"],
            optional=True,
            extra_compile_args=["-O2", "-Wall"],
        ),
        Extension(
            "pipeline.gateway._admit",
            sources=["pipeline/gateway/_admit.c"],
            depends=["pipeline/serde/_avro.h", "pipeline/serde/_request.h"],
            optional=True,
            extra_compile_args=["-O2", "-Wall"],
        ),
    ]
)
