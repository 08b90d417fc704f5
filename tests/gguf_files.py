"""Tiny llama GGUF files for the import tests, written with mx.save_gguf and mlx-lm's own GGUF naming
and q/k permutation (mlx_lm.gguf), so the import is checked against another implementation."""

import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
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


# --- quantized tensors, written by hand in llama.cpp's block layouts (mx.save_gguf writes floats only) ---

GGML_TYPE = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def quantize(x: np.ndarray, kind: str) -> tuple[bytes, np.ndarray]:
    """`x` (rows, k·32) in llama.cpp's block layout for `kind`, and the values those blocks decode to."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    if kind == "Q8_0":  # f16 scale, 32 int8
        d = (np.abs(blocks).max(1, keepdims=True) / 127).astype(np.float16)
        q = np.round(blocks / np.where(d == 0, 1, d)).clip(-127, 127).astype(np.int8)
        raw = [d[i].tobytes() + q[i].tobytes() for i in range(len(blocks))]
        return b"".join(raw), (d.astype(np.float32) * q).reshape(x.shape)
    if kind == "Q4_0":  # f16 scale, 16 bytes of nibbles: value (q - 8)·d, d = signed max / -8
        at = np.abs(blocks).argmax(1)
        d = (blocks[np.arange(len(blocks)), at] / -8)[:, None].astype(np.float16)
        q = (np.round(blocks / np.where(d == 0, 1, d)) + 8).clip(0, 15).astype(np.uint8)
        values = (q.astype(np.float32) - 8) * d.astype(np.float32)
        heads = [d[i].tobytes() for i in range(len(blocks))]
    else:  # Q4_1: f16 scale and minimum, 16 bytes of nibbles: value q·d + m
        m = blocks.min(1, keepdims=True).astype(np.float16)
        d = ((blocks.max(1, keepdims=True) - m.astype(np.float32)) / 15).astype(np.float16)
        q = np.round((blocks - m.astype(np.float32)) / np.where(d == 0, 1, d)).clip(0, 15).astype(np.uint8)
        values = q.astype(np.float32) * d.astype(np.float32) + m.astype(np.float32)
        heads = [d[i].tobytes() + m[i].tobytes() for i in range(len(blocks))]
    low = q[:, :16] | (q[:, 16:] << 4)  # byte j: weight j in the low nibble, weight j + 16 in the high
    return b"".join(h + low[i].tobytes() for i, h in enumerate(heads)), values.reshape(x.shape)


def write_quantized_gguf(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """A GGUF holding only `tensors` (name -> (kind, float array)); returns what each decodes to."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    infos, data, decoded = b"", b"", {}
    for name, (kind, x) in tensors.items():
        raw, decoded[name] = quantize(x, kind)
        data += b"\0" * (-len(data) % 32)
        infos += string(name) + struct.pack("<I", x.ndim) + b"".join(struct.pack("<Q", n) for n in reversed(x.shape))
        infos += struct.pack("<IQ", GGML_TYPE[kind], len(data))
        data += raw
    kv = string("general.architecture") + struct.pack("<I", 8) + string("llama")
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1) + kv + infos
    path.write_bytes(head + b"\0" * (-len(head) % 32) + data)
    return decoded
