"""Deterministic answer text: token ``i`` of an answer depends only on (model, prompt, i)."""

from __future__ import annotations

import zlib

_WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "iris", "jasper",
          "kelp", "lumen", "maple", "nectar", "onyx", "pebble", "quartz", "river", "sage", "tundra",
          "umber", "violet", "willow", "xenon", "yarrow", "zephyr")


def answer_seed(model: str, prompt: str) -> int:
    return zlib.crc32(prompt.encode(), zlib.crc32(model.encode()))


def token_text(seed: int, index: int) -> str:
    """One token's text: a word with its leading space (none for the first)."""
    word = _WORDS[(seed + index * 2654435761) % len(_WORDS)]
    return word if index == 0 else " " + word


def answer_text(model: str, prompt: str, n_tokens: int) -> str:
    """The whole answer the simulator gives in ``n_tokens`` tokens (for tests and demos)."""
    seed = answer_seed(model, prompt)
    return "".join(token_text(seed, i) for i in range(n_tokens))


def count_prompt_tokens(text: str) -> int:
    """The simulator's tokenizer: about four characters per token, at least one."""
    return max(1, (len(text) + 3) // 4)
