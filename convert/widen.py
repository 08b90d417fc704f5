"""Widen a llama-family mlx-lm model without changing its function, so it costs what a bigger model costs.

Our real models are tiny (width 64), so their per-token time is dispatch overhead, not the
memory-bound regime that speculative decoding is about. A widened copy computes the very same
logits while every forward does the work of the widened shape (docs/design.md §7, with the
benchmark pair): widths are zero-padded, RMSNorm weights scaled by √(d/D) and ε by d/D (qwen3's
q/k projections by √(d/D) too, for its per-head norms), original query heads keep their own kv head,
new heads are zero, and new layers are identities (a copy of the block before with zero o_proj and
down_proj), original block i at layer ⌊i·L/n⌋. An SS draft keeps its stream rows exact too (`widen_ss`).
"""

import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
from tqdm import tqdm

from mirror_mlx.drafts.ss.model import load_ss_draft
from mirror_mlx.engine.exit_adapter import ExitAdapter, adapter_meta, load_adapter, save_adapter

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json")


class WidenError(ValueError):
    """A shape or model that cannot be widened (the message is one sentence saying why)."""


@dataclass
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    layers: int
    head_dim: int

    @classmethod
    def of(cls, config: dict) -> "Shape":
        heads = config["num_attention_heads"]
        hd = config.get("head_dim") or config["hidden_size"] // heads
        return cls(config["hidden_size"], heads, config.get("num_key_value_heads") or heads,
                   config["intermediate_size"], config["num_hidden_layers"], hd)


def head_layout(h: int, k: int, H: int, K: int) -> tuple[list[int], list[Optional[int]]]:
    """New position of each original query head, and the original kv head each new kv head copies:
    mlx attention gives query head p the kv head p // (H/K), so original group j (g = h/k query
    heads) takes ⌈g/G⌉ consecutive new kv heads, all copies of kv head j, and fills their first slots."""
    g, G = h // k, H // K
    per = -(-g // G)
    q_pos = [((i // g) * per + (i % g) // G) * G + (i % g) % G for i in range(h)]
    kv_src: list[Optional[int]] = [None] * K
    for j in range(k):
        for t in range(per):
            kv_src[j * per + t] = j
    return q_pos, kv_src


def check_shape(config: dict, new: Shape) -> None:
    """Raise WidenError unless `new` can hold the model of `config` exactly."""
    mt = config.get("model_type")
    if mt not in SUPPORTED:
        raise WidenError(f"model type {mt!r} is not supported: widen handles {', '.join(SUPPORTED)}")
    if "quantization" in config or "quantization_config" in config:
        raise WidenError("the model is quantized: widen a float model (mlx_lm.convert --dequantize) instead")
    if any(t != "full_attention" for t in config.get("layer_types") or ()) or config.get("use_sliding_window"):
        raise WidenError("sliding-window layers are not supported: widen a model with full attention only")
    old = Shape.of(config)
    for name in ("hidden", "heads", "kv_heads", "intermediate", "layers"):
        if getattr(new, name) < getattr(old, name):
            raise WidenError(f"{name} {getattr(new, name)} is smaller than the model's {getattr(old, name)}: "
                             "widen only grows a model")
    if new.heads % new.kv_heads:
        raise WidenError(f"heads {new.heads} is not a multiple of kv heads {new.kv_heads}")
    g, G = old.heads // old.kv_heads, new.heads // new.kv_heads
    if old.kv_heads * -(-g // G) > new.kv_heads:
        raise WidenError(f"{new.kv_heads} kv heads cannot serve {new.heads} heads with the model's grouping "
                         f"({old.heads} heads on {old.kv_heads} kv heads): use more kv heads")
    if mt == "qwen2" and new.heads * old.head_dim != new.hidden:
        raise WidenError(f"qwen2 needs heads × head_dim = hidden: use {new.hidden // old.head_dim} heads "
                         f"for hidden {new.hidden} (head_dim {old.head_dim})")


def _blocks(w: mx.array, src: list[Optional[int]], size: int) -> mx.array:
    """Rebuild axis 0 from blocks of `size` rows: block i of the result is source block src[i] or zeros."""
    zero = mx.zeros((size,) + w.shape[1:], dtype=w.dtype)
    return mx.concatenate([zero if j is None else w[j * size : (j + 1) * size] for j in src])


def _pad(w: mx.array, shape: tuple[int, ...]) -> mx.array:
    return mx.pad(w, [(0, n - m) for m, n in zip(w.shape, shape)])


def _pad_in(w: mx.array, D: int) -> mx.array:
    """Zero-pad a projection's input dim to D (a bias has none)."""
    return _pad(w, (w.shape[0], D)) if w.ndim == 2 else w


def widen_layer(w: dict[str, mx.array], old: Shape, new: Shape, s: float, qk: float) -> dict[str, mx.array]:
    """One block's weights (keys relative to the block) in the new shape."""
    D, F, hd = new.hidden, new.intermediate, old.head_dim
    q_pos, kv_src = head_layout(old.heads, old.kv_heads, new.heads, new.kv_heads)
    q_src: list[Optional[int]] = [None] * new.heads
    for i, p in enumerate(q_pos):
        q_src[p] = i
    heads = {"self_attn.q_proj": (q_src, qk), "self_attn.k_proj": (kv_src, qk), "self_attn.v_proj": (kv_src, 1.0)}
    padded = {"self_attn.o_proj.bias": (D,), "mlp.down_proj.bias": (D,), "mlp.gate_proj.weight": (F, D),
              "mlp.up_proj.weight": (F, D), "mlp.gate_proj.bias": (F,), "mlp.up_proj.bias": (F,),
              "mlp.down_proj.weight": (D, F)}
    out = {}
    for key, x in w.items():
        proj = key.rpartition(".")[0]
        if key in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[key] = _pad(x * s, (D,))
        elif key in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            out[key] = x
        elif proj in heads:
            src, scale = heads[proj]
            out[key] = _blocks(_pad_in(x, D), src, hd) * scale
        elif key == "self_attn.o_proj.weight":
            out[key] = _pad(_blocks(x.T, q_src, hd).T, (D, new.heads * hd))
        elif key in padded:
            out[key] = _pad(x, padded[key])
        else:
            raise WidenError(f"unexpected weight {key!r} in a transformer block: this model is not plain llama-family")
    return out


def identity_layer(w: dict[str, mx.array]) -> dict[str, mx.array]:
    """A copy of a (widened) block whose output projections are zero, so it adds nothing to the residual."""
    out_proj = ("self_attn.o_proj.", "mlp.down_proj.")
    return {k: mx.zeros_like(x) if k.startswith(out_proj) else x for k, x in w.items()}


def widen_weights(weights: dict[str, mx.array], config: dict, new: Shape) -> dict[str, mx.array]:
    """All weights (mlx-lm names, after sanitize) of `config`'s model in the shape `new`."""
    check_shape(config, new)
    old = Shape.of(config)
    s = math.sqrt(old.hidden / new.hidden)
    qk = s if config["model_type"] == "qwen3" else 1.0
    V, D = config["vocab_size"], new.hidden
    layers: list[dict[str, mx.array]] = [{} for _ in range(old.layers)]
    out = {}
    for key, x in weights.items():
        if key.startswith("model.layers."):
            i, rest = key[len("model.layers."):].split(".", 1)
            layers[int(i)][rest] = x
        elif key in ("model.embed_tokens.weight", "lm_head.weight"):
            out[key] = _pad(x, (V, D))
        elif key == "model.norm.weight":
            out[key] = _pad(x * s, (D,))
        else:
            raise WidenError(f"unexpected weight {key!r}: this model is not plain llama-family")
    slots = {block_slot(i, old.layers, new.layers): i for i in range(old.layers)}
    block: dict[str, mx.array] = {}
    for slot in range(new.layers):  # an identity layer copies the block before it
        block = widen_layer(layers[slots[slot]], old, new, s, qk) if slot in slots else identity_layer(block)
        out.update({f"model.layers.{slot}.{k}": x for k, x in block.items()})
    return out


def widened_config(config: dict, new: Shape) -> dict:
    old = Shape.of(config)
    c = dict(config, hidden_size=new.hidden, num_attention_heads=new.heads, num_key_value_heads=new.kv_heads,
             intermediate_size=new.intermediate, num_hidden_layers=new.layers, head_dim=old.head_dim,
             rms_norm_eps=config["rms_norm_eps"] * old.hidden / new.hidden)
    if "layer_types" in c and c["layer_types"] is not None:
        c["layer_types"] = ["full_attention"] * new.layers
    if "max_window_layers" in c:
        c["max_window_layers"] = new.layers
    return c


def block_slot(block: int, old_layers: int, new_layers: int) -> int:
    """The widened layer that holds original block `block` (identity layers fill the gaps)."""
    return block * new_layers // old_layers


def widen_ss(weights: dict[str, mx.array], config: dict, new: Shape) -> tuple[dict[str, mx.array], dict]:
    """A Speculative-Streaming draft's weights and config in the shape `new`, main and stream rows exact:
    the stream embeddings are zero-padded like the residual stream they are added to, and every layer
    from the one holding the original first stream block up (the same residual state; identities add
    nothing to stream rows either) becomes a stream layer."""
    llama_config = {k: v for k, v in config.items() if k not in ("num_streams", "stream_layers")}
    llama_config["model_type"] = "llama"
    weights = dict(weights)
    se = weights.pop("stream_embeddings", None)
    if se is None:
        raise WidenError("the SS draft has no stream_embeddings weight: it is not a Speculative-Streaming draft")
    out = widen_weights(weights, llama_config, new)
    out["stream_embeddings"] = _pad(se, (se.shape[0], new.hidden))
    old = Shape.of(config)
    spawn = block_slot(old.layers - config.get("stream_layers", 2), old.layers, new.layers)
    c = widened_config(config, new)
    c["stream_layers"] = new.layers - spawn
    return out, c


def widen(model_dir: Path, out: Path, hidden: int, heads: int, intermediate: int, layers: int,
          kv_heads: Optional[int] = None, progress: bool = False) -> Path:
    """Write a function-preserving widened copy of the mlx-lm model folder (or SS draft) `model_dir` to `out`.

    kv_heads defaults to the model's heads/kv-heads ratio; `progress`: a bar on stderr over the tensors."""
    model_dir, out = Path(model_dir), Path(out)
    if not (model_dir / "config.json").is_file():
        raise WidenError(f"{model_dir} is not an mlx-lm model folder (it has no config.json)")
    if out.resolve() == model_dir.resolve():
        raise WidenError("--out must differ from --model: widen writes a new folder")
    config = json.loads((model_dir / "config.json").read_text())
    ss = config.get("model_type") == "ss_llama"
    old = Shape.of(config)
    if kv_heads is None:
        if (heads * old.kv_heads) % old.heads:
            raise WidenError(f"heads {heads} does not keep the model's ratio of {old.heads} heads to "
                             f"{old.kv_heads} kv heads: give --kv-heads")
        kv_heads = heads * old.kv_heads // old.heads
    new = Shape(hidden, heads, kv_heads, intermediate, layers, old.head_dim)
    check_shape(dict(config, model_type="llama") if ss else config, new)  # before reading any weights
    if ss:
        model, _ = load_ss_draft(model_dir, with_tokenizer=False)
        weights, new_config = widen_ss(dict(tree_flatten(model.parameters())), config, new)
    else:
        model, _ = load_model(model_dir, lazy=True)
        weights = widen_weights(dict(tree_flatten(model.parameters())), config, new)
        new_config = widened_config(config, new)
    if progress:  # the weights are lazy until here: compute them one by one, then the save only writes
        for name in tqdm(list(weights), desc=f"widen {model_dir.name}", unit="tensor", file=sys.stderr):
            mx.eval(weights[name])
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not any(f.match(p) for p in WEIGHT_FILES):
            shutil.copyfile(f, out / f.name)  # tokenizer files, generation config, licence, ...
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(new_config, indent=2, sort_keys=True) + "\n")
    return out


def exact_exit_layers(exit_layer: int, old_layers: int, new_layers: int) -> list[int]:
    """The widened exit layers whose state is the original state after `exit_layer` blocks: original
    block ℓ−1 sits at slot ⌊(ℓ−1)·L/n⌋ and only identities follow it up to original block ℓ."""
    first = block_slot(exit_layer - 1, old_layers, new_layers) + 1
    last = exit_layer * new_layers // old_layers if exit_layer < old_layers else new_layers
    return list(range(first, last + 1))


def widen_adapter(adapter_path: Path, model_dir: Path, widened_dir: Path, out: Path) -> list[int]:
    """Write the exit adapter of `model_dir` for its widened copy `widened_dir`; returns its exact layers.
    The adapter x ↦ x + up(act(down(x))) stays exact with down's inputs and up's outputs zero-padded."""
    small, _ = load_model(Path(model_dir), lazy=True)
    try:
        adapter = load_adapter(adapter_path, small)
    except ValueError as e:
        raise WidenError(str(e)) from None
    config = json.loads((Path(model_dir) / "config.json").read_text())
    wide_config = json.loads((Path(widened_dir) / "config.json").read_text())
    old, new = Shape.of(config), Shape.of(wide_config)
    if new.hidden < old.hidden or new.layers < old.layers or wide_config["vocab_size"] != config["vocab_size"]:
        raise WidenError(f"{widened_dir} is not a widened copy of {model_dir} "
                         "(its shape is smaller or its vocabulary differs)")
    D = new.hidden
    wide = ExitAdapter(D, adapter.rank, adapter.mlp)
    wide.down.weight = _pad(adapter.down.weight, (adapter.rank, D))
    if adapter.mlp:
        wide.down.bias = adapter.down.bias
    wide.up.weight = _pad(adapter.up.weight, (D, adapter.rank))
    wide.up.bias = _pad(adapter.up.bias, (D,))
    layers = exact_exit_layers(adapter.exit_layer, old.layers, new.layers)
    wide_model, _ = load_model(Path(widened_dir), lazy=True)
    meta = adapter_meta(wide_model, layers[-1], exit_layers=",".join(map(str, layers)),
                        widened_from=Path(adapter_path).name, source_exit_layer=adapter.exit_layer)
    save_adapter(out, wide, meta)
    return layers
