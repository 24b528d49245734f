"""How many tokens a text is, before a model has said: about 4 characters a token.

The gateway charges a request's prompt at this estimate to the token buckets before it runs,
and a worker whose model server reports no usage reports this estimate instead; the two must
agree, or the buckets' settlement (estimate charged, real usage refunded or charged) drifts.
It is a rule of thumb for English BPE vocabularies, not a tokenizer: the settlement with the
server's own count corrects it wherever the server reports one.
"""

from __future__ import annotations


def estimate_tokens(text: str) -> int:
    """At least one token, and one more for every 4 characters or part of them."""
    return max(1, (len(text) + 3) // 4)
