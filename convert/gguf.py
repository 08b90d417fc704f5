"""Import a llama-architecture GGUF file (llama.cpp's format) as an mlx-lm model folder.

The folder is a plain mlx-lm llama model: config.json, model.safetensors (dequantized to the
machine's dtype), tokenizer.json (a byte-level BPE rebuilt from the file's vocabulary and merges)
and tokenizer_config.json (its chat template and special tokens). llama.cpp stores q/k rows in
interleaved RoPE order; they are put back in mlx-lm's half-split order, as for llama2.c. The header is
read first, so that a file this import cannot take is refused with its reason before MLX reads any weights.
"""

import json
import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from .llama2c import interleaved_to_half_split

if TYPE_CHECKING:
    import mlx.core as mx
    from tokenizers import Tokenizer

# ggml tensor type -> (name, elements per block, bytes per block); the types this import reads.
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34)}
OTHER_TYPES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
               15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
               22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
               30: "BF16"}
# gguf metadata value type -> struct format of a fixed-size value (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# tokenizer.ggml.pre -> whether digits are split one by one before GPT-2's byte-level regex
PRE_TOKENIZERS = {"gpt2": False, "smollm": True}
NAMES = {  # GGUF tensor names -> mlx-lm llama names
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
FIX = "convert the Hugging Face checkpoint with mlx_lm.convert instead"


class GGUFError(ValueError):
    """A GGUF file this import cannot take (the message names the problem and what to do)."""


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order (the file lists the fastest dimension first)
    type: int
    offset: int  # from the start of the data section

    @property
    def nbytes(self) -> int:
        _, block, size = TYPES[self.type]
        return math.prod(self.shape) // block * size


def read_header(path: Path) -> tuple[dict[str, Any], list[Tensor], int]:
    """The metadata, the tensor table and the data section's offset, checked against the file's size
    (a truncated download is named as such) and the tensor types this import reads."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path} does not exist: give the path of a .gguf file")
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{path} is not a GGUF file ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _parse(path, buf, size)


def _parse(path: Path, buf: mmap.mmap, size: int) -> tuple[dict[str, Any], list[Tensor], int]:
    pos = 4

    def span(n: int) -> int:
        """The offset of the next n bytes, which the file must hold."""
        nonlocal pos
        if pos + n > len(buf):
            raise GGUFError(f"{path} ends inside its header ({size} bytes): the file is truncated, download it again")
        pos += n
        return pos - n

    def take(fmt: str) -> Any:
        return struct.unpack_from("<" + fmt, buf, span(struct.calcsize("<" + fmt)))[0]

    def string() -> str:
        n = take("Q")
        start = span(n)
        return bytes(buf[start:start + n]).decode("utf-8", errors="replace")

    def value(kind: int) -> Any:
        if kind in SCALARS:
            return take(SCALARS[kind])
        if kind == 8:
            return string()
        if kind == 9:
            elem, n = take("I"), take("Q")
            if elem in SCALARS:  # numbers: one read
                dt = np.dtype("<" + SCALARS[elem])
                return np.frombuffer(buf, dt, n, span(n * dt.itemsize)).tolist()
            return [value(elem) for _ in range(n)]
        raise GGUFError(f"{path}: metadata value type {kind} is not GGUF's: the file is corrupt, download it again")

    if buf[:4] != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    version = take("I")
    if version not in (2, 3):
        raise GGUFError(f"{path} is GGUF version {version}; only versions 2 and 3 are read: "
                        "re-export it with a current llama.cpp")
    n_tensors, n_kv = take("Q"), take("Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("I"))
    tensors = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        tensors.append(Tensor(name, tuple(reversed(dims)), take("I"), take("Q")))
    align = int(meta.get("general.alignment", 32))
    data = (pos + align - 1) // align * align
    for t in tensors:
        if t.type not in TYPES:
            kind = OTHER_TYPES.get(t.type, f"type {t.type}")
            raise GGUFError(f"{path}: tensor {t.name} is {kind}, which this import does not read "
                            f"(it reads {', '.join(n for n, _, _ in TYPES.values())}): "
                            "use a GGUF of one of those types, or " + FIX)
        if data + t.offset + t.nbytes > size:
            raise GGUFError(f"{path} is truncated: tensor {t.name} ends at byte {data + t.offset + t.nbytes} "
                            f"but the file has {size}; download it again")
    return meta, tensors, data


def need(meta: dict, key: str, path: Path) -> Any:
    if key not in meta:
        raise GGUFError(f"{path} lacks the metadata key {key}: the file is incomplete; "
                        "use a GGUF written by llama.cpp's converter, or " + FIX)
    return meta[key]


def mlx_config(meta: dict, tensors: list[Tensor], path: Path) -> dict:
    """config.json for mlx-lm's llama from the file's llama.* metadata."""
    arch = need(meta, "general.architecture", path)
    if arch != "llama":
        raise GGUFError(f"{path} holds a '{arch}' model; this import reads the llama architecture only: " + FIX)
    if "llama.expert_count" in meta:
        raise GGUFError(f"{path} is a mixture-of-experts llama; this import reads dense llama models only: " + FIX)
    p = "llama."
    hidden, heads = int(need(meta, p + "embedding_length", path)), int(need(meta, p + "attention.head_count", path))
    head_dim = int(meta.get(p + "attention.key_length", meta.get(p + "rope.dimension_count", hidden // heads)))
    names = {t.name for t in tensors}
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(need(meta, p + "feed_forward_length", path)),
        "num_hidden_layers": int(need(meta, p + "block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(need(meta, p + "attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need(meta, p + "context_length", path)),
        "tie_word_embeddings": "output.weight" not in names,
    }
    scaling = meta.get(p + "rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(meta[p + "rope.scaling.factor"])}
    elif scaling not in (None, "none"):
        raise GGUFError(f"{path} uses '{scaling}' RoPE scaling, which this import does not read: " + FIX)
    return config


def hf_name(name: str, path: Path) -> str:
    m = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.weight", name)
    if m is None or m.group(2) not in NAMES or \
            (m.group(1) is None) != (m.group(2) in ("token_embd", "output_norm", "output")):
        raise GGUFError(f"{path} holds tensor {name}, which a plain llama does not have "
                        "(biases, RoPE factors or another architecture's layers): " + FIX)
    layer, base = m.groups()
    return f"{NAMES[base]}.weight" if layer is None else f"model.layers.{layer}.{NAMES[base]}.weight"


def mlx_weights(path: Path, tensors: list[Tensor], config: dict, dtype: "mx.Dtype") -> dict:
    """The file's tensors read by MLX, dequantized to `dtype`, renamed, q/k rows put back in
    half-split RoPE order."""
    try:
        raw = cast(dict[str, mx.array], mx.load(str(path)))  # (a .gguf file: its tensors)
    except (RuntimeError, ValueError) as e:
        raise GGUFError(f"{path} cannot be read ({e}): download it again") from None
    out = {}
    for t in tensors:
        key = t.name[: -len(".weight")]
        w = raw[t.name]
        if key + ".scales" in raw:  # Q4_0 / Q4_1 / Q8_0: MLX's affine form, 32 weights per group
            scales = raw[key + ".scales"]
            w = mx.dequantize(w, scales, raw[key + ".biases"], group_size=32, bits=w.shape[-1] // scales.shape[-1])
        w = w.astype(dtype)
        name = hf_name(t.name, path)
        heads = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}.get(name.split(".")[-2])
        out[name] = interleaved_to_half_split(w, config[heads]) if heads else w
    return out


def tokenizer_files(meta: dict, path: Path, context: int) -> tuple["Tokenizer", dict]:
    """A `tokenizers.Tokenizer` (byte-level BPE, special tokens added) and tokenizer_config.json."""
    kind = need(meta, "tokenizer.ggml.model", path)
    if kind != "gpt2":
        raise GGUFError(f"{path} has a '{kind}' tokenizer; this import rebuilds byte-level BPE ('gpt2') "
                        "tokenizers only: " + FIX)
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{path}: pre-tokenizer '{pre}' is not one this import rebuilds "
                        f"({', '.join(PRE_TOKENIZERS)}): " + FIX)
    tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
    types = meta["tokenizer.ggml.token_type"]
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise GGUFError(f"{path}: a merge is not two tokens separated by one space: the file is corrupt")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if PRE_TOKENIZERS[pre] else byte_level)
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, k in enumerate(types) if k == 3]  # llama.cpp's CONTROL tokens
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    bos, eos, unk, pad = token("bos"), token("eos"), token("unknown"), token("padding")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad,
        "add_bos_token": add_bos, "add_eos_token": False,
        "additional_special_tokens": [s for s in special if s not in (bos, eos, unk, pad)],
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, {k: v for k, v in config.items() if v is not None}


def import_gguf(path: Path, out: Path, dtype: "Optional[mx.Dtype]" = None) -> Path:
    """Convert the GGUF file `path` into an mlx-lm model folder at `out` (dtype: the one the product runs
    models in here, float16 on a Metal GPU, float32 on a CPU)."""
    path, out = Path(path), Path(out)
    meta, tensors, _ = read_header(path)
    config = mlx_config(meta, tensors, path)
    for t in tensors:
        hf_name(t.name, path)  # refuse before reading any weights
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        need(meta, key, path)
    tokenizer, tok_config = tokenizer_files(meta, path, config["max_position_embeddings"])
    vocab = len(meta["tokenizer.ggml.tokens"])
    config["vocab_size"] = vocab
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            config[name] = int(meta[f"tokenizer.ggml.{key}_token_id"])
    dtype = dtype or (mx.float16 if mx.metal.is_available() else mx.float32)
    config["torch_dtype"] = {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(dtype, "float32")
    weights = mlx_weights(path, tensors, config, dtype)
    embed = weights["model.embed_tokens.weight"]
    if embed.shape[0] != vocab:
        raise GGUFError(f"{path}: the embedding has {embed.shape[0]} rows but the vocabulary {vocab} tokens: "
                        "the file is corrupt, download it again")
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
