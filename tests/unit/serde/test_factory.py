"""codec_for: the codec a process builds from its [serde] settings."""

from __future__ import annotations

import subprocess
import sys

from pipeline.config import Settings
from pipeline.serde import Codec, SerdeLimits
from pipeline.serde.factory import codec_for
from tests.unit.serde import REPO_ROOT, full_request


def test_default_settings_share_the_default_codec():
    assert codec_for(Settings().serde) is Codec.default()


def test_limits_and_registry_come_from_the_settings():
    serde = Settings().serde
    serde.max_string_bytes = 100
    serde.registry_url = "mock://factory"
    codec = codec_for(serde)
    assert codec.limits == SerdeLimits(max_string_bytes=100)
    data = codec.encode_request(full_request(), wire="confluent", topic="t")
    assert data[:1] == b"\x00" and codec.decode_request(data) == full_request()


def test_any_object_with_the_settings_shape_will_do():
    class Options:
        registry_url = ""

        def limits(self):
            return SerdeLimits(max_metadata_entries=3)

    assert codec_for(Options()).limits.max_metadata_entries == 3


def test_serde_does_not_import_config():
    # config is at the bottom of the import graph (it imports serde.limits)
    code = ("import sys, pipeline.serde, pipeline.serde.factory; "
            "print(sorted(m for m in sys.modules if m.startswith('pipeline.config')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
