"""Only the optional C extension lives here; everything else is in pyproject.toml.

``pipeline.serde._native`` is the C twin of the codec pipeline/serde/fastpath.py generates;
``pipeline.worker._lane`` is the worker's fast lane (pipeline/worker/fastlane.py);
``pipeline.gateway._admit`` the gateway's admission lane (pipeline/gateway/admitlane.py). Without a
C compiler the build skips them (``optional=True``) and llmq runs on the Python code alone,
with the same results.
"""

from setuptools import Extension, setup

HEADERS = ["pipeline/serde/_avro.h", "pipeline/serde/_request.h"]
EXTENSIONS = {
    "pipeline.serde._native": "pipeline/serde/_native.c",
    "pipeline.worker._lane": "pipeline/worker/_lane.c",
    "pipeline.gateway._admit": "pipeline/gateway/_admit.c",
}

setup(
    ext_modules=[
        Extension(name, sources=[source], depends=HEADERS, optional=True, extra_compile_args=["-O2", "-Wall"])
        for name, source in EXTENSIONS.items()
    ]
)
