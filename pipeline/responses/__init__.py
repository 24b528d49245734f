"""OpenAI's Responses API on the durable queue: stored responses and background state in one
compacted topic (:mod:`.store`), their shapes and stream events (:mod:`.shapes`, :mod:`.events`),
answers found again after a serve process went away (:mod:`.recover`), streams replayed from the
chunks topic (:mod:`.replay`). The HTTP endpoints are pipeline/serve/responses_api.py."""
