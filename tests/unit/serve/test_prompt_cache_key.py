"""prompt_cache_key from the front door: carried in the request's metadata to the worker, where
the routing reads it."""

from __future__ import annotations

import pytest

from pipeline.openai_api.chat import CACHE_KEY_METADATA, CHAT, COMPLETION, parse_body
from pipeline.openai_api.errors import ApiError
from pipeline.worker.backends.affinity import CACHE_KEY


def test_prompt_cache_key_rides_in_metadata_beside_the_callers_own():
    parsed = parse_body({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         "prompt_cache_key": "user-42", "metadata": {"team": "a"}}, CHAT, 16)
    assert parsed.fields["metadata"] == {"team": "a", CACHE_KEY_METADATA: "user-42"}
    assert CACHE_KEY_METADATA == CACHE_KEY  # what the worker's routing reads
    parsed = parse_body({"model": "m", "prompt": "hi", "prompt_cache_key": "k"}, COMPLETION, 16)
    assert parsed.fields["metadata"] == {CACHE_KEY_METADATA: "k"}
    assert "metadata" not in parse_body({"model": "m", "prompt": "hi"}, COMPLETION, 16).fields


@pytest.mark.parametrize("key", [42, "x" * 1025])
def test_a_bad_prompt_cache_key_is_400_naming_it(key):
    with pytest.raises(ApiError) as err:
        parse_body({"model": "m", "prompt": "hi", "prompt_cache_key": key}, COMPLETION, 16)
    assert "prompt_cache_key" in str(err.value.body if hasattr(err.value, "body") else err.value)
