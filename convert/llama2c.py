"""Import a llama2.c checkpoint (legacy `.bin`) plus its sentencepiece model as an MLX model folder.

The folder is a plain mlx-lm llama model: `mlx_lm.load(folder)` reads it unchanged.
llama2.c rotates interleaved (even, odd) pairs for RoPE while mlx-lm's llama rotates the two
halves of each head, so the q/k rows are permuted as the Hugging Face Llama converter does.
"""

import json
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import mlx.core as mx
import numpy as np
import sentencepiece as spm
from transformers import LlamaTokenizer

if TYPE_CHECKING:
    import mlx.core as mx

Rows = TypeVar("Rows", np.ndarray, "mx.array")  # numpy's or MLX's: both reshape and transpose alike

HEADER = struct.Struct("<7i")


class ImportError_(ValueError):
    """A llama2.c checkpoint or tokenizer that cannot be imported (message says why and what to do)."""


@dataclass
class Llama2cConfig:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    def n_floats(self) -> int:
        d, h, L, kv = self.dim, self.hidden_dim, self.n_layers, self.n_kv_heads * self.head_size
        n = self.vocab_size * d  # embedding
        n += L * (d + d * d + 2 * d * kv + d * d + d + 3 * d * h)  # attention, norms, MLP
        n += d + self.seq_len * self.head_size  # final norm, freq_cis real + imag
        if not self.shared_classifier:
            n += self.vocab_size * d
        return n


def read_checkpoint(path: Path) -> tuple[Llama2cConfig, dict[str, np.ndarray]]:
    """Read the header and all fp32 weights; weights come back in mlx-lm llama naming."""
    path = Path(path)
    if not path.is_file():
        raise ImportError_(f"checkpoint not found: {path} (give the path of a llama2.c .bin file)")
    raw = path.read_bytes()
    if len(raw) < HEADER.size:
        raise ImportError_(f"{path} is too small to be a llama2.c checkpoint ({len(raw)} bytes)")
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = HEADER.unpack_from(raw)
    cfg = Llama2cConfig(dim, hidden, n_layers, n_heads, n_kv, abs(vocab), seq_len, vocab > 0)
    if min(dim, hidden, n_layers, n_heads, n_kv, cfg.vocab_size, seq_len) <= 0 or dim % n_heads:
        raise ImportError_(f"{path}: header {HEADER.unpack_from(raw)} is not a llama2.c legacy header")
    expected = HEADER.size + 4 * cfg.n_floats()
    if len(raw) != expected:
        raise ImportError_(
            f"{path} has {len(raw)} bytes but its header {HEADER.unpack_from(raw)} implies {expected}: "
            "the file is truncated, corrupt, or not in llama2.c's legacy (version 0) format"
        )
    flat = np.frombuffer(raw, dtype="<f4", offset=HEADER.size)
    pos = 0

    def take(*shape: int) -> np.ndarray:
        nonlocal pos
        n = int(np.prod(shape))
        out = flat[pos : pos + n].reshape(shape).copy()
        pos += n
        return out

    d, kv = dim, n_kv * cfg.head_size
    emb = take(cfg.vocab_size, d)
    stacked = {name: take(n_layers, *shape) for name, shape in (  # every layer's, in the file's order
        ("input_layernorm", (d,)), ("self_attn.q_proj", (d, d)), ("self_attn.k_proj", (kv, d)),
        ("self_attn.v_proj", (kv, d)), ("self_attn.o_proj", (d, d)), ("post_attention_layernorm", (d,)),
        ("mlp.gate_proj", (hidden, d)), ("mlp.down_proj", (d, hidden)), ("mlp.up_proj", (hidden, d)))}
    w = {"model.embed_tokens.weight": emb, "model.norm.weight": take(d)}
    take(seq_len * cfg.head_size)  # freq_cis_real, freq_cis_imag: recomputed by mlx-lm's RoPE
    if not cfg.shared_classifier:
        w["lm_head.weight"] = take(cfg.vocab_size, d)
    rope_heads = {"self_attn.q_proj": n_heads, "self_attn.k_proj": n_kv}
    for name, per_layer in stacked.items():
        for i, x in enumerate(per_layer):
            heads = rope_heads.get(name)
            w[f"model.layers.{i}.{name}.weight"] = x if heads is None else interleaved_to_half_split(x, heads)
    return cfg, w


def interleaved_to_half_split(w: Rows, n_heads: int) -> Rows:
    """Reorder q/k output rows from interleaved RoPE pairs to mlx-lm's half-split layout."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def mlx_config(cfg: Llama2cConfig) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_size,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": cfg.seq_len,
        "tie_word_embeddings": cfg.shared_classifier,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def save_tokenizer(spm_model: Path, vocab_size: int, out: Path) -> None:
    """Write the sentencepiece model as Hugging Face tokenizer files (BOS added, as llama2.c does)."""
    spm_model = Path(spm_model)
    if not spm_model.is_file():
        raise ImportError_(f"tokenizer not found: {spm_model} (give the sentencepiece .model file)")
    try:
        n = spm.SentencePieceProcessor(model_file=str(spm_model)).get_piece_size()
    except Exception as e:  # sentencepiece raises RuntimeError/OSError on garbage
        raise ImportError_(f"{spm_model} is not a sentencepiece model ({e})") from None
    if n != vocab_size:
        raise ImportError_(
            f"tokenizer {spm_model} has {n} tokens but the checkpoint's vocabulary has {vocab_size}: "
            "use the tokenizer the checkpoint was trained with"
        )
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(spm_model, Path(tmp) / "tokenizer.model")
        tok = LlamaTokenizer.from_pretrained(tmp, add_bos_token=True, add_eos_token=False, legacy=False)
        tok.save_pretrained(str(out))
    shutil.copyfile(spm_model, out / "tokenizer.model")


def import_llama2c(checkpoint: Path, tokenizer: Path, out: Path) -> Path:
    """Convert `checkpoint` + `tokenizer` into an mlx-lm model folder at `out`."""
    cfg, weights = read_checkpoint(Path(checkpoint))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(Path(tokenizer), cfg.vocab_size, out)
    mx.save_safetensors(
        str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}, metadata={"format": "mlx"}
    )
    (out / "config.json").write_text(json.dumps(mlx_config(cfg), indent=2, sort_keys=True) + "\n")
    return out
