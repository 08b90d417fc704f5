"""The Speculative-Streaming draft model: a llama decoder whose top layers also carry stream rows.

One forward over main rows x_0..x_{L-1} emits, per main row t, the main prediction (token t+1) and
`num_streams` stream predictions (stream j predicts token t+1+j), all from one shared LM head. At layer
N-N_s every main row t spawns stream rows h_t + P_j (P_j learned); in the top N_s layers (docs/design.md
§5.3) main row t attends to main rows <= t only, so the main stream *is* a plain llama, and stream (t, j)
to main rows <= t and streams 1..j of row t, at position t + j (RoPE tells it how far ahead it looks).
Stream rows are never cached.

The weights are llama's plus `stream_embeddings` (S, D), so any mlx-lm llama with the target's tokenizer
initialises it, and `Model.__call__` is the plain llama forward: the folder works wherever a plain draft does.
"""

import json
import shutil
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.utils import dequantize_model, load_config, load_model

from mirror_mlx.drafts.tokenizer import folder_tokenizer

MODEL_TYPE = "ss_llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "rope_theta", "rope_traditional",
                 "max_position_embeddings", "tie_word_embeddings", "num_streams", "stream_layers")


@dataclass
class ModelArgs(llama.ModelArgs):
    num_streams: int = 3
    stream_layers: int = 2

    def __post_init__(self):
        super().__post_init__()
        if self.num_streams < 1:
            raise ValueError(f"num_streams must be at least 1, got {self.num_streams}")
        if not 1 <= self.stream_layers <= self.num_hidden_layers:
            raise ValueError(f"stream_layers must be in 1..{self.num_hidden_layers} (the number of "
                             f"layers), got {self.stream_layers}")


class Model(llama.Model):
    """llama.Model plus the stream embeddings P_j; calling it runs the main stream only."""

    args: ModelArgs

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.stream_embeddings = 0.02 * mx.random.normal((args.num_streams, args.hidden_size))

    @property
    def layers(self) -> list:
        return self.model.layers


@dataclass
class SSOutput:
    main: mx.array  # (B, L, V) logits: row t predicts token t+1 (identical to a plain llama forward)
    streams: mx.array  # (B, S, L, V) logits: [b, j-1, t] predicts token t+1+j
    kv: list[tuple[mx.array, mx.array]]  # per layer, the new main rows' (keys, values) (B, Hkv, L, hd)


def _head(model: Model, h: mx.array) -> mx.array:
    h = model.model.norm(h)
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


def _main_mask(L: int, past_valid: Optional[mx.array]) -> mx.array:
    """Boolean (B or 1, L, P + L): main row t sees the visible past and main rows <= t."""
    idx = mx.arange(L)
    causal = (idx[None, :] <= idx[:, None])[None]
    if past_valid is None:
        return causal
    B = max(causal.shape[0], past_valid.shape[0])
    past = mx.broadcast_to(past_valid[:, None, :], (B, L, past_valid.shape[-1]))
    return mx.concatenate([past, mx.broadcast_to(causal, (B, L, L))], axis=-1)


def _stream_attention(q, k, v, ks, vs, mask, scale):
    """Stream rows' attention: to the main keys under `mask`, and to streams 1..j of their own row.

    q (B, H, S, L, hd); k, v (B, Hkv, N, hd) main keys; ks, vs (B, Hkv, S, L, hd) stream keys; mask (B or
    1, L, N). One softmax over both key sets; (rep, S, L) flattened into one row axis, so the (S·L)² scores
    of one masked attention over all rows are never formed."""
    B, H, S, L, hd = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    rep = H // Hkv
    q = (q * scale).reshape(B, Hkv, rep * S * L, hd)
    s_main = (q @ k.swapaxes(-1, -2)).reshape(B, Hkv, rep, S, L, N)
    s_main = mx.where(mask[:, None, None, None], s_main, -mx.inf)
    qt = q.reshape(B, Hkv, rep, S, L, hd).transpose(0, 1, 2, 4, 3, 5)  # (B, Hkv, rep, L, S, hd)
    s_own = qt @ ks.transpose(0, 1, 3, 4, 2)[:, :, None]  # (B, Hkv, rep, L, S, S)
    s_own = mx.where(mx.tril(mx.ones((S, S), dtype=mx.bool_)), s_own, -mx.inf)  # stream j sees j' <= j
    p = mx.softmax(mx.concatenate([s_main, s_own.transpose(0, 1, 2, 4, 3, 5)], -1), axis=-1, precise=True)
    out = p[..., :N].reshape(B, Hkv, rep * S * L, N) @ v
    p_own = p[..., N:].transpose(0, 1, 2, 4, 3, 5)  # (B, Hkv, rep, L, S, S)
    own = (p_own @ vs.transpose(0, 1, 3, 2, 4)[:, :, None]).transpose(0, 1, 2, 4, 3, 5)  # (.., S, L, hd)
    return (out.reshape(B, Hkv, rep, S, L, hd) + own).reshape(B, H, S * L, hd)


def _block(block: nn.Module, x: mx.array, L: int, offset: Union[int, mx.array],
           past: Optional[tuple[mx.array, mx.array]], mask: mx.array):
    """A llama TransformerBlock over row groups of L rows: main rows, then S stream groups (group g at
    positions offset + g + t)."""
    attn = block.self_attn
    B, R, _ = x.shape
    G = R // L
    h = block.input_layernorm(x)
    q = attn.q_proj(h).reshape(B, R, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(h).reshape(B, R, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(h).reshape(B, R, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q = mx.concatenate([attn.rope(q[:, :, g * L:(g + 1) * L], offset=offset + g) for g in range(G)], 2)
    k = mx.concatenate([attn.rope(k[:, :, g * L:(g + 1) * L], offset=offset + g) for g in range(G)], 2)
    new_kv = (k[:, :, :L], v[:, :, :L])
    km, vm = new_kv
    if past is not None:  # one concatenation of every part (a batch-1 prefix broadcast into it)
        def rows(parts):
            return [mx.broadcast_to(p, (B,) + p.shape[1:]) for p in (parts if isinstance(parts, list) else [parts])]
        km, vm = mx.concatenate(rows(past[0]) + [km], axis=2), mx.concatenate(rows(past[1]) + [vm], axis=2)
    o = mx.fast.scaled_dot_product_attention(q[:, :, :L], km, vm, scale=attn.scale, mask=mask[:, None])
    if G > 1:
        def streams(a):
            return a[:, :, L:].reshape(B, a.shape[1], G - 1, L, -1)
        o_s = _stream_attention(streams(q), km, vm, streams(k), streams(v), mask, attn.scale)
        o = mx.concatenate([o, o_s], axis=2)
    x = x + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(B, R, -1))
    return x + block.mlp(block.post_attention_layernorm(x)), new_kv


def ss_forward(model: Model, tokens: mx.array, offset: Union[int, mx.array] = 0,
               past: Optional[list[tuple[mx.array, mx.array]]] = None,
               past_valid: Optional[mx.array] = None) -> SSOutput:
    """Main and stream logits for main rows `tokens` (B, L) at positions offset + t.

    `past`: per layer, keys/values (B or 1, Hkv, P, hd) the rows may attend to (the committed prefix and the
    branch's own earlier rows), whole or as a list of parts along P (the block concatenates them with the new
    rows once, so a batch-1 prefix is copied once per forward); `past_valid` (B, P): which of them each row
    sees (None: all). Training calls it with the tokens only.
    """
    B, L = tokens.shape
    S = model.args.num_streams
    first_stream = len(model.layers) - model.args.stream_layers
    if past is not None and past_valid is None:
        k = past[0][0]
        past_valid = mx.ones((B, sum(p.shape[2] for p in k) if isinstance(k, list) else k.shape[2]), dtype=mx.bool_)
    mask = _main_mask(L, past_valid)
    x = model.model.embed_tokens(tokens)
    kv = []
    for i, block in enumerate(model.layers):
        if i == first_stream:
            P = model.stream_embeddings.astype(x.dtype)
            x = mx.concatenate([x] + [x + P[j] for j in range(S)], axis=1)
        x, layer_kv = _block(block, x, L, offset, None if past is None else past[i], mask)
        kv.append(layer_kv)
    logits = _head(model, x)
    return SSOutput(main=logits[:, :L], streams=logits[:, L:].reshape(B, S, L, -1), kv=kv)


def is_ss_draft(path: Union[str, Path]) -> bool:
    """True for a local folder holding an SS draft (what `mirror_mlx.load(draft_model=...)` asks)."""
    with suppress(OSError, ValueError):  # no config.json, or not JSON
        return json.loads((Path(path) / "config.json").read_text()).get("model_type") == MODEL_TYPE
    return False


def load_ss_draft(path: Union[str, Path], with_tokenizer: bool = True):
    """(model, tokenizer) from an SS draft folder; the tokenizer is None when not asked for."""
    path = Path(path)
    if not is_ss_draft(path):
        raise ValueError(f"{path} is not a Speculative-Streaming draft folder (config.json with "
                         f'"model_type": "{MODEL_TYPE}")')
    model, _ = load_model(path, get_model_classes=lambda config: (Model, ModelArgs))
    if not with_tokenizer:
        return model, None

    return model, folder_tokenizer(path)


def save_ss_draft(model: Model, path: Union[str, Path], tokenizer_from: Union[str, Path, None] = None,
                  extra_config: Optional[dict] = None) -> None:
    """Write config.json + model.safetensors, and copy the tokenizer files of `tokenizer_from`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    a = model.args
    config = {"model_type": MODEL_TYPE, "architectures": ["SSLlamaForCausalLM"], "torch_dtype": "float32",
              **{name: getattr(a, name) for name in CONFIG_FIELDS}}
    for name in ("attention_bias", "mlp_bias", "rope_scaling"):  # an --init-from model's, kept when set
        if getattr(a, name, None):
            config[name] = getattr(a, name)
    config.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_from) / name
            if src.is_file() and src.resolve() != (path / name).resolve():
                shutil.copyfile(src, path / name)


def float_weights(folder: Union[str, Path]) -> dict:
    """A model folder's weights by name; a 4/8-bit (mlx-lm quantized) model's dequantized by mlx-lm."""
    config = load_config(Path(folder))
    if "quantization" not in config and "quantization_config" not in config:
        return {k: v for wf in sorted(Path(folder).glob("model*.safetensors")) for k, v in
                cast(dict[str, mx.array], mx.load(str(wf))).items()}

    model, _ = load_model(Path(folder))
    return dict(tree_flatten(dequantize_model(model).parameters()))


def new_model(args: ModelArgs, init_from: Union[str, Path, None] = None) -> Model:
    """A fresh SS model, with every llama weight taken from `init_from` when given (its stream embeddings only
    if it is an SS draft with the same stream count)."""
    model = Model(args)
    if init_from is not None:
        weights = model.sanitize(float_weights(init_from))
        se = weights.get("stream_embeddings")
        if se is None or se.shape != model.stream_embeddings.shape:
            weights["stream_embeddings"] = model.stream_embeddings
        dtype = model.stream_embeddings.dtype  # the draft trains in the fresh model's precision
        model.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())
    return model


def config_args(path: Union[str, Path], **ss_fields) -> ModelArgs:
    """ModelArgs from a model folder's config.json, with the SS fields set or overridden."""
    config = load_config(Path(path))
    config.update({k: v for k, v in ss_fields.items() if v is not None})
    config["model_type"] = MODEL_TYPE
    return ModelArgs.from_dict(config)
