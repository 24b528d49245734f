"""OpenAI's request and answer shapes, in one home below every service that speaks them.

``chat.py`` parses chat and completion bodies into a request's fields and renders answers and
stream chunks; ``responses.py`` does the same for the Responses API; ``errors.py`` is OpenAI's
error shape and which HTTP status each of the pipeline's answers gets. ``llmq serve``
(pipeline/serve/), the Batch API's lines (pipeline/batch/) and the Responses API
(pipeline/responses/, pipeline/serve/responses_api.py) all use them; none of them imports another
for a shape.
"""
