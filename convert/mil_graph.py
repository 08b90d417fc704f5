"""The draft's MIL program: what the converter (convert/coreml.py) builds each package function from.

ANE layout (ml-ane-transformers, Anemll): activations are (1, C, 1, T); every linear is a 1x1 conv; RMSNorm is
layer_norm over [x, -x] (mean 0, so LayerNorm gives RMS statistics without squaring in fp16); SiLU is written
x*sigmoid(x); the attention scale is folded into q weights. The package's inputs, outputs and state are
described in convert/coreml.py.
"""

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from mirror_mlx.ane_draft.package_format import Shapes

if TYPE_CHECKING:
    from coremltools.converters.mil.mil import Builder, Var
    import numpy.typing as npt

HEAD_SPLIT = 16384  # ANE per-axis limit (Anemll: "ANE tensors dimension size is limited to 16384")


@dataclass
class DraftSpec:
    """What the builder needs from an mlx-lm draft: its shape and its weights as float32 numpy."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    weights: dict[str, np.ndarray]  # '{layer}.q_proj', 'embed', 'head', ... (see coreml.spec_from_model)
    cos: np.ndarray  # (P, head_dim/2) RoPE table from the model's own rope module
    sin: np.ndarray
    config: dict[str, Any]
    tokenizer_sha256: str
    draft_sha256: str
    streams: int = 0  # SS drafts: stream rows per main row, carried by the top `stream_layers`
    stream_layers: int = 0
    tied: bool = False  # the head is the embedding table: the package stores it once
    kept_ids: Optional[np.ndarray] = None  # a distilled draft: the ids its `vocab` head rows score (ascending)
    tokenizer_meta: dict[str, str] = field(default_factory=dict)  # package_format.tokenizer_metadata

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


def _f16(a: "npt.ArrayLike") -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16)


def _conv_w(w: np.ndarray, scale: float = 1.0) -> np.ndarray:
    return _f16(w * scale)[:, :, None, None]


def build_function(spec: DraftSpec, shapes: Shapes, fn: str, progress: Optional[Callable[[], None]] = None):
    """The MIL function 'extend' or 'rollout' of the package."""
    import coremltools as ct  # (coremltools: an extra off macOS)
    from coremltools.converters.mil import Builder as mb  # (coremltools: an extra off macOS)
    from coremltools.converters.mil.mil import Function, types  # (coremltools: an extra off macOS)

    T = shapes.chunk if fn == "extend" else shapes.rows
    Sk = shapes.context if fn == "extend" else shapes.slots  # state slots this function reads
    NS = spec.streams if fn == "rollout" else 0  # stream rows per main row (SS drafts)
    TS = T * NS
    L, KV, D = spec.layers, spec.kv_heads, spec.head_dim
    specs = {
        "input_ids": mb.TensorSpec((1, T), dtype=types.int32),
        "positions": mb.TensorSpec((T,), dtype=types.int32),
        "write_pos": mb.TensorSpec((1,), dtype=types.int32),
        "mask": mb.TensorSpec((1, Sk + T, T), dtype=types.fp16),
    }
    if NS:
        specs["stream_positions"] = mb.TensorSpec((TS,), dtype=types.int32)
        specs["stream_mask"] = mb.TensorSpec((1, Sk + T + TS, TS), dtype=types.fp16)
    specs["kv_cache"] = mb.StateTensorSpec((2 * L, KV, D, shapes.slots), dtype=types.fp16)
    with Function(specs, opset_version=ct.target.iOS18) as func:
        func.set_outputs(_forward(_Ops(mb, spec), func.inputs, T, Sk, NS, progress))
    return func


class _Ops:
    """The decoder's pieces in ANE form, over one spec's weights."""

    def __init__(self, mb: "type[Builder]", spec: DraftSpec):
        self.mb, self.spec, self.w = mb, spec, spec.weights

    def rms(self, x, weight, shape):  # over axis 1
        mb = self.mb
        both = mb.concat(values=[x, mb.mul(x=x, y=np.float16(-1.0))], axis=1)
        half = mb.split(x=mb.layer_norm(x=both, axes=[1], epsilon=np.float16(self.spec.eps)), num_splits=2, axis=1)[0]
        return mb.mul(x=half, y=_f16(weight).reshape(shape))

    def conv(self, x, name, scale=1.0):
        b = self.w.get(f"{name}.bias")
        return self.mb.conv(x=x, weight=_conv_w(self.w[name], scale), bias=None if b is None else _f16(b * scale))

    def rope(self, t, cos, sin):  # t: (n, D, R)
        mb = self.mb
        a, b = mb.split(x=t, num_splits=2, axis=1)
        return mb.add(x=mb.mul(x=t, y=cos), y=mb.mul(x=mb.concat(values=[b, a], axis=1), y=sin))

    def attend(self, q, keys, values, mask, n):
        """q (H, D, n) over key blocks [(KV, D, m_i)] with the additive key-major mask."""
        mb, s = self.mb, self.spec
        H, KV, D, G = s.heads, s.kv_heads, s.head_dim, s.groups
        if G > 1:  # (KV*G, D, n) -> (KV, D, G*n)
            q = mb.reshape(x=mb.transpose(x=mb.reshape(x=q, shape=[KV, G, D, n]), perm=[0, 2, 1, 3]),
                           shape=[KV, D, G * n])
        scores = [mb.matmul(x=k, y=q, transpose_x=True) for k in keys]  # (KV, m_i, G*n)
        p = mb.softmax(x=mb.add(x=mb.concat(values=scores, axis=1), y=mask), axis=1)
        parts = mb.split(x=p, split_sizes=[k.shape[2] for k in keys], axis=1)
        o = mb.matmul(x=values[0], y=parts[0])
        for v, pv in zip(values[1:], parts[1:]):
            o = mb.add(x=o, y=mb.matmul(x=v, y=pv))  # (KV, D, G*n)
        if G > 1:
            o = mb.transpose(x=mb.reshape(x=o, shape=[KV, D, G, n]), perm=[0, 2, 1, 3])
        return mb.reshape(x=o, shape=[1, H * D, 1, n])


def _forward(ops: _Ops, inp: dict, T: int, Sk: int, NS: int, progress: Optional[Callable[[], None]]) -> list:
    """The decoder over T main rows (plus T*NS stream rows in the top layers of an SS draft)."""
    mb, spec, w = ops.mb, ops.spec, ops.w
    L, KV, D, G, C, TS = spec.layers, spec.kv_heads, spec.head_dim, spec.groups, spec.hidden, T * NS
    cache = mb.read_state(input=inp["kv_cache"])
    ids = mb.reshape(x=inp["input_ids"], shape=[T])
    head = head_consts(mb, spec)
    if spec.tied:  # the lookup reads the head's own pieces: one table in the package
        x = _lookup(mb, head, ids, T, C)
    else:
        x = mb.gather(x=_f16(w["embed"]), indices=ids, axis=0)  # (T, C)
    x = mb.reshape(x=mb.transpose(x=x, perm=[1, 0]), shape=[1, C, 1, T])
    pos = inp["positions"] if not NS else mb.concat(values=[inp["positions"], inp["stream_positions"]], axis=0)
    cos = mb.gather(x=_f16(spec.cos.T), indices=pos, axis=1)  # (D/2, R)
    sin = mb.gather(x=_f16(spec.sin.T), indices=pos, axis=1)
    rot_all = (mb.concat(values=[cos, cos], axis=0),  # (D, R), sin signed for rotate_half
               mb.concat(values=[mb.mul(x=sin, y=np.float16(-1.0)), sin], axis=0))
    rot_main = rot_all if not NS else tuple(mb.split(x=r, split_sizes=[T, TS], axis=1)[0] for r in rot_all)
    tile = lambda m: m if G == 1 else mb.tile(x=m, reps=[1, 1, G])  # noqa: E731
    mask, smask = tile(inp["mask"]), tile(inp["stream_mask"]) if NS else None  # (1, Sk+T, G*T)
    first_stream = L - spec.stream_layers if NS else L
    new_kv = []
    for i in range(L):
        if i == first_stream:  # every main row spawns NS stream rows h_t + P_j, stream-major
            P = _f16(w["stream_embeddings"])
            x = mb.concat(values=[x] + [mb.add(x=x, y=P[j].reshape(1, C, 1, 1)) for j in range(NS)], axis=3)
        kc, vc = (mb.reshape(x=mb.slice_by_size(x=cache, begin=[2 * i + j, 0, 0, 0], size=[1, KV, D, Sk]),
                             shape=[KV, D, Sk]) for j in (0, 1))
        streams = i >= first_stream
        x, kv = _layer(ops, i, x, (kc, vc), rot_all if streams else rot_main, mask, smask if streams else None, T)
        new_kv += kv
        if progress:
            progress()
    x = ops.rms(x, w["norm"], (1, C, 1, 1))
    begin = mb.concat(values=[np.zeros(3, np.int32), inp["write_pos"]], axis=0)
    end = mb.add(x=begin, y=np.array([2 * L, KV, D, T], np.int32))
    upd = mb.concat(values=[mb.reshape(x=t, shape=[1, KV, D, T]) for t in new_kv], axis=0)
    mb.coreml_update_state(state=inp["kv_cache"], value=mb.slice_update(x=cache, update=upd, begin=begin, end=end))
    return _logits(mb, head, x, T, TS)


def _layer(ops: _Ops, i: int, x: "Var", cached: tuple, rot: tuple, mask: "Var", smask: "Var",
           T: int) -> tuple["Var", list]:
    """Decoder layer i over x's rows, and the main rows' new K and V; with `smask` the rows past T are stream
    rows, which attend to the main rows and to each other's but are never seen by main rows and write no K/V."""
    mb, w, s = ops.mb, ops.w, ops.spec
    H, KV, D, C = s.heads, s.kv_heads, s.head_dim, s.hidden
    R = x.shape[3]
    h = ops.rms(x, w[f"{i}.input_norm"], (1, C, 1, 1))
    qn = f"{i}.q_norm" in w
    scale = D ** -0.5
    q = mb.reshape(x=ops.conv(h, f"{i}.q_proj", 1.0 if qn else scale), shape=[H, D, R])
    k = mb.reshape(x=ops.conv(h, f"{i}.k_proj"), shape=[KV, D, R])
    v = mb.reshape(x=ops.conv(h, f"{i}.v_proj"), shape=[KV, D, R])
    if qn:
        q = ops.rms(q, w[f"{i}.q_norm"] * scale, (1, D, 1))
        k = ops.rms(k, w[f"{i}.k_norm"], (1, D, 1))
    q, k = ops.rope(q, *rot), ops.rope(k, *rot)
    kc, vc = cached
    if smask is not None:
        (qm, qs), (km, ks), (vm, vs) = (mb.split(x=t, split_sizes=[T, R - T], axis=2) for t in (q, k, v))
        o = mb.concat(values=[ops.attend(qm, [kc, km], [vc, vm], mask, T),  # main rows never see streams
                              ops.attend(qs, [kc, km, ks], [vc, vm, vs], smask, R - T)], axis=3)
    else:
        km, vm = k, v
        o = ops.attend(q, [kc, k], [vc, v], mask, T)
    x = mb.add(x=x, y=ops.conv(o, f"{i}.o_proj"))
    h = ops.rms(x, w[f"{i}.post_norm"], (1, C, 1, 1))
    g = ops.conv(h, f"{i}.gate_proj")
    act = mb.mul(x=mb.mul(x=g, y=mb.sigmoid(x=g)), y=ops.conv(h, f"{i}.up_proj"))  # SiLU as x*sigmoid(x)
    return mb.add(x=x, y=ops.conv(act, f"{i}.down_proj")), [km, vm]


def _logits(mb: "type[Builder]", head: list, x: "Var", T: int, TS: int) -> list:
    """The LM head (split at the ANE's per-axis limit) over the main rows, then over the stream rows."""
    outs, stream_outs = [], []
    n = len(head)
    for j, part in enumerate(head):
        Vj = part.shape[0]
        y = mb.transpose(x=mb.reshape(x=mb.conv(x=x, weight=part), shape=[Vj, T + TS]), perm=[1, 0])
        suffix = "" if n == 1 else f"_{j}"
        if TS:
            ym, ys = mb.split(x=y, split_sizes=[T, TS], axis=0)
            outs.append(mb.reshape(x=ym, shape=[1, T, Vj], name="logits" + suffix))
            stream_outs.append(mb.reshape(x=ys, shape=[1, TS, Vj], name="stream_logits" + suffix))
        else:
            outs.append(mb.reshape(x=y, shape=[1, T, Vj], name="logits" + suffix))
    return outs + stream_outs


def head_names(spec: DraftSpec) -> list[str]:
    return [f"lm_head_{j}" for j in range(math.ceil(spec.vocab / HEAD_SPLIT))]


def head_consts(mb: "type[Builder]", spec: DraftSpec) -> list:
    """The LM head as named (Vj, C, 1, 1) fp16 consts, split at the ANE's per-axis limit."""
    head = spec.weights["head"]
    return [mb.const(val=_conv_w(head[j * HEAD_SPLIT : (j + 1) * HEAD_SPLIT]), name=name)
            for j, name in enumerate(head_names(spec))]


def _lookup(mb: "type[Builder]", pieces: list, ids: "Var", T: int, C: int) -> "Var":
    """Embedding rows (T, C) gathered from the head's pieces: each piece serves the ids in its
    range (index clamped, row zeroed elsewhere), and exactly one piece serves each id."""
    x, start = None, 0
    for piece in pieces:
        Vj = piece.shape[0]
        local = mb.sub(x=ids, y=np.int32(start)) if start else ids
        below, above = mb.greater_equal(x=local, y=np.int32(0)), mb.greater_equal(x=local, y=np.int32(Vj))
        idx = mb.select(cond=above, a=np.zeros(T, np.int32), b=mb.select(cond=below, a=local, b=np.zeros(T, np.int32)))
        rows = mb.reshape(x=mb.gather(x=piece, indices=idx, axis=0), shape=[T, C])
        if len(pieces) > 1:
            inside = mb.sub(x=mb.cast(x=below, dtype="fp16"), y=mb.cast(x=above, dtype="fp16"))  # 1 in range, else 0
            rows = mb.mul(x=rows, y=mb.reshape(x=inside, shape=[T, 1]))
        x = rows if x is None else mb.add(x=x, y=rows)
        start += Vj
    return x
