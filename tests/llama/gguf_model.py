"""A tiny random-weight ``llama``-architecture GGUF that llama.cpp loads and runs.

Nothing it says is meaningful: the weights are random (deterministic from a seed), the
vocabulary is a SentencePiece-style byte-fallback one (the 256 ``<0xNN>`` byte tokens,
which can spell any UTF-8 text, plus a few word pieces), and the file is a few hundred
kilobytes. It exists so that the tests talk to a real llama.cpp server doing real
tokenisation, prefill, decoding, sampling and streaming.

Two choices make its output usable by tests:

* the output-projection rows of the control tokens (``<unk>``, ``<s>``, ``</s>``) and of
  every byte outside printable ASCII are zero, while the other rows have logits of
  several units: ``</s>`` is never among the top-k candidates, so a generation runs to
  ``max_tokens`` (tests can size a stream by it), and the text is valid UTF-8;
* the chat template is stored in the file, so the server formats messages without a
  ``--chat_format`` that a random model would not match anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The word pieces after the byte tokens; "▁" (U+2581) marks a leading space, as SentencePiece does.
_WORDS = ("the", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "are", "with", "as",
          "be", "at", "one", "have", "this", "from", "or", "had", "by", "word", "but", "what", "some",
          "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said",
          "an", "each", "she", "which", "do", "their", "time", "if", "will", "way", "about", "many",
          "then", "them", "write", "would", "like", "so", "these", "her", "long", "make", "thing", "see")
_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                  "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
UNK, BOS, EOS = 0, 1, 2
FIRST_BYTE = 3


@dataclass(frozen=True)
class TinyLlamaShape:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    context_length: int = 512


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, their SentencePiece scores and their GGUF token types."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u2581" + w for w in _WORDS]
    for i, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(TokenType.NORMAL)
        # SentencePiece merges the highest-scored pair first: longer pieces win over letters.
        scores.append(-float(len(pieces) - i) if len(piece) == 1 else -1.0 + len(piece) / 100.0)
    return tokens, scores, [int(t) for t in types]


def _sampleable(tokens: list[str]) -> np.ndarray:
    """Tokens the model may emit: printable ASCII bytes and the word pieces."""
    mask = np.zeros(len(tokens), dtype=bool)
    for i, tok in enumerate(tokens):
        if i < FIRST_BYTE:
            continue
        if i < FIRST_BYTE + 256:
            mask[i] = 0x20 <= i - FIRST_BYTE <= 0x7E
        else:
            mask[i] = True
    return mask


def write_tiny_llama(directory: Path | str, seed: int = 0, shape: TinyLlamaShape = TinyLlamaShape(),
                     name: str = "tiny-llama.gguf") -> Path:
    """Write the model into ``directory`` and return its path; the same seed gives the same bytes."""
    import gguf

    path = Path(directory) / name
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocabulary()
    n_vocab, d, head_dim = len(tokens), shape.n_embd, shape.n_embd // shape.n_head
    kv_dim = head_dim * shape.n_head_kv

    def matrix(rows: int, cols: int, scale: float) -> np.ndarray:
        # numpy's (rows, cols) is ggml's ne = [cols, rows]: cols is the input dimension.
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float16)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("llmq tiny random llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(d)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(_CHAT_TEMPLATE)

    writer.add_tensor("token_embd.weight", matrix(n_vocab, d, 1.0))
    for i in range(shape.n_layer):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", np.ones(d, dtype=np.float32))
        writer.add_tensor(blk + "attn_q.weight", matrix(d, d, d ** -0.5))
        writer.add_tensor(blk + "attn_k.weight", matrix(kv_dim, d, d ** -0.5))
        writer.add_tensor(blk + "attn_v.weight", matrix(kv_dim, d, d ** -0.5))
        writer.add_tensor(blk + "attn_output.weight", matrix(d, d, d ** -0.5))
        writer.add_tensor(blk + "ffn_norm.weight", np.ones(d, dtype=np.float32))
        writer.add_tensor(blk + "ffn_gate.weight", matrix(shape.n_ff, d, d ** -0.5))
        writer.add_tensor(blk + "ffn_up.weight", matrix(shape.n_ff, d, d ** -0.5))
        writer.add_tensor(blk + "ffn_down.weight", matrix(d, shape.n_ff, shape.n_ff ** -0.5))
    writer.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    output = matrix(n_vocab, d, 0.6)
    output[~_sampleable(tokens)] = 0
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
