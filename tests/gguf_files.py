"""Tiny llama GGUF files for the import tests, written with mx.save_gguf and mlx-lm's own GGUF naming
and q/k permutation (mlx_lm.gguf), so the import is checked against another implementation."""

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.gguf import permute_weights, translate_weight_names

from tests.models import CONFIGS, tiny_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = [chr(c) for c in range(ord("!"), ord("!") + 91)] + ["Ġ"]  # byte-level symbols: ASCII, the space
TOKENS = SPECIALS + CHARS + ["ab", "Ġa"]  # 97: tests.models' vocabulary size
MERGES = ["a b", "Ġ a"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def metadata(config: dict, **overrides) -> dict:
    """The llama.* and tokenizer.ggml.* keys llama.cpp's converter writes for `config`."""
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": "llama",
        "llama.context_length": u32(512),
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(config["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
        "llama.rope.dimension_count": u32(config["head_dim"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": mx.array([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)), dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.chat_template": TEMPLATE,
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


def write_tiny_gguf(path: Path, family: str = "llama_tied", dtype=mx.float32, seed: int = 0, **overrides):
    """The tiny random model `family` written to `path` as llama.cpp lays it out; returns the model."""
    config = CONFIGS[family]
    model = tiny_model(family, seed)
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        if "q_proj" in name:
            w = permute_weights(w, config["num_attention_heads"])
        elif "k_proj" in name:
            w = permute_weights(w, config["num_attention_heads"], config["num_key_value_heads"])
        weights[translate_weight_names(name)] = w.astype(dtype)
    mx.save_gguf(str(path), weights, metadata(config, **overrides))
    return model
