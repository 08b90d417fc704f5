"""An MLX draft as a Core ML package for the Neural Engine, built with the MIL builder (no torch).

One `.mlpackage`, two functions sharing weights and one state, all shapes static (ANE needs them):

    L layers, n_kv KV heads of size d, vocab V, context S, chunk E, rows B = kappa*(gamma+1),
    scratch W = B*(gamma+1), slots K = S + W

    state   kv_cache   (2L, n_kv, d, K) fp16   K then V of every layer, slots last (a block of new
                       rows is one slice_update): [0, S) committed tokens, [S, K) rollout scratch.
    extend  (T = E)    input_ids (1, E) int32, positions (E,) int32, write_pos (1,) int32,
                       mask (1, S + E, E) fp16  ->  logits (1, E, V) fp16
                       a chunk of committed tokens, its K/V written at [write_pos, write_pos + E).
    rollout (T = B)    input_ids (1, B), positions (B,), write_pos (1,), mask (1, K + B, B)  ->  logits (1, B, V)
                       one batched forward over branch rows, written to scratch (write_pos >= S).
    SS drafts          B = kappa*(gamma+1)*(1+N); rollout also takes stream_positions (B*N,) and
                       stream_mask (1, K + B + B*N, B*N) and returns stream_logits (1, B*N, V): in the
                       top stream layers row j*B + b is stream j+1 of main row b; stream rows write no
                       K/V and main rows never see them.

The mask is additive (0 attend, -1e4 blocked) and key-major, mask[0, key, query]; keys are the
state's slots, then the call's own rows. The host builds masks and positions, so the two functions
serve prefill, tree attention, stream rows and rollback (stale slots are masked, never erased).
With V > 16384 the LM head is split (ANE's per-axis limit) into logits_0..logits_{n-1}. A distilled
draft (mirror_distilled) keeps its trimmed head: V is its rows, the kept ids, which the package records
(metadata `kept_ids`) and the host maps every logit column through. The program itself is built in
convert/mil_graph.py.
"""

import contextlib
import functools
import hashlib
import json
import logging
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Union

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from mirror_mlx.ane_draft.package_format import (FORMAT, META, ConvertError, Shapes, import_coremltools,
                                                 kept_ids_metadata, read_kept_ids, tokenizer_metadata,
                                                 tokenizer_sha256)
from mirror_mlx.engine.model_parts import text_model
from mirror_mlx.loading import load_model
from mirror_mlx.options import PAPER_KNOBS

from .mil_graph import DraftSpec, build_function, head_names

if TYPE_CHECKING:
    from types import SimpleNamespace
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.converters.mil.mil import Program
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# ss_llama: mirror_mlx/drafts/ss/model.py; mirror_distilled: mirror_mlx/drafts/distilled/model.py
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "ss_llama", "mirror_distilled")
QUANTIZE = ("none", "int8", "lut4", "lut6")
VOCAB_PAD = 1024  # unused rows a model may pad its vocabulary with (Qwen3: 151,669 tokens in 151,936)


if sys.platform != "darwin":  # coremltools warns "Failed to load _MLModelProxy" at import on Linux
    logging.getLogger("coremltools").setLevel(logging.ERROR)


@contextlib.contextmanager
def quiet_coremltools():
    """Silence coremltools' own per-pass progress bars (we show one bar for the whole build)."""
    from coremltools.converters.mil.mil.passes import pass_pipeline  # (coremltools: an extra off macOS)
    from coremltools.optimize.coreml import _quantization_passes  # (coremltools: an extra off macOS)

    modules = (pass_pipeline, _quantization_passes)
    saved = [m.tqdm for m in modules]
    for m, bar in zip(modules, saved):
        m.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        for m, bar in zip(modules, saved):
            m.tqdm = bar


# --------------------------------------------------------------------------- reading the draft


def _np(a: "mx.array", copy: bool = True) -> np.ndarray:
    """float32 numpy (copy=False: a read-only view of MLX's float32 array where it can be, e.g. to hash it)."""
    return (np.array if copy else np.asarray)(a.astype(mx.float32))


def _dense(layer: "nn.Module", copy: bool = True) -> np.ndarray:
    """Weight (out, in) of a Linear/Embedding, dequantizing quantized MLX layers."""
    w = layer.weight
    if hasattr(layer, "scales"):  # in float32: the scales' own bf16/fp16 would round every weight
        kw = {"mode": layer.mode} if hasattr(layer, "mode") else {}
        f32 = lambda a: None if a is None else a.astype(mx.float32)  # noqa: E731
        w = mx.dequantize(w, layer.scales.astype(mx.float32), f32(getattr(layer, "biases", None)), layer.group_size,
                          layer.bits, **kw)
    return _np(w, copy)


def _weights_sha256(weights: Mapping[str, Union[np.ndarray, Callable[[], np.ndarray]]]) -> str:
    """The draft's identity: every weight (an array, or a function that makes one) in key order."""
    h = hashlib.sha256()
    for k in sorted(weights):
        w = weights[k]
        w = w() if callable(w) else w
        h.update(k.encode())
        h.update(np.ascontiguousarray(w, dtype=np.float32).view(np.uint8).data)  # no copy
    return h.hexdigest()


def _rope_table(rope: "nn.Module", head_dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of every position, read off the model's own rope module (any scaling it uses)."""
    if getattr(rope, "traditional", False):
        raise ConvertError("interleaved ('traditional') RoPE is not supported; use a half-split RoPE draft")
    dims = getattr(rope, "dims", getattr(rope, "dim", head_dim))
    if dims != head_dim:
        raise ConvertError(f"partial RoPE ({dims} of {head_dim} dims) is not supported")
    h = head_dim // 2
    probe = np.zeros((1, 1, positions, head_dim), np.float32)
    probe[..., :h] = 1.0
    out = np.array(rope(mx.array(probe)).astype(mx.float32))[0, 0]
    cos, sin = out[:, :h], out[:, h:]
    # check the half-split formula reproduces the module on random input
    x = np.random.default_rng(0).standard_normal((1, 1, 8, head_dim)).astype(np.float32)
    ref = np.array(rope(mx.array(x)).astype(mx.float32))
    c, s = cos[:8], sin[:8]
    mine = np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)
    if not np.allclose(mine, ref, atol=1e-4):
        raise ConvertError(f"the draft's RoPE ({type(rope).__name__}) is not a half-split rotation")
    return cos, sin


def read_draft(path: Path, positions: int) -> DraftSpec:
    """Load an mlx-lm draft folder and pull out what the builder needs (float32 numpy)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConvertError(f"{path} is not an MLX model folder (no config.json); give --draft-model a folder")
    config = json.loads((path / "config.json").read_text())
    mt = config.get("model_type")
    if mt not in SUPPORTED:
        raise ConvertError(
            f"draft architecture '{mt}' is not supported by the Core ML converter "
            f"(supported: {', '.join(SUPPORTED)}); use the MLX draft folder directly instead"
        )

    try:
        model, tokenizer = load_model(path)  # refuses a tokenizer with ids beyond the model's vocabulary
    except ValueError as e:
        raise ConvertError(str(e)) from None
    check_tokenizer(tokenizer, int(getattr(model.args, "vocab_size", 0) or config.get("vocab_size", 0)), path)
    spec = spec_from_model(model, config, tokenizer_sha256(tokenizer), positions)
    spec.tokenizer_meta = tokenizer_metadata(tokenizer)
    return spec


def check_tokenizer(tokenizer: "TokenizerWrapper", vocab: int, path: Path) -> None:
    """Refuse a tokenizer that is not the model's: ids (special ones included) at or beyond the model's
    vocabulary, or a vocabulary more than VOCAB_PAD rows larger (models pad a few rows, never thousands)."""
    ids = list(tokenizer.get_vocab().values()) + [i for i in getattr(tokenizer, "all_special_ids", []) if i is not None]
    size, top = len(tokenizer), max(ids) + 1
    if top > vocab or vocab - size > VOCAB_PAD:
        raise ConvertError(
            f"the tokenizer in {path} has {size:,} tokens (ids up to {top - 1:,}) but the model's vocabulary "
            f"has {vocab:,}: it is not this model's tokenizer; put the draft's own tokenizer files in {path}"
        )


def _weight_sources(model: "nn.Module", copy: bool = True) -> dict[str, Callable[[], np.ndarray]]:
    """Every weight the builder reads by key ('embed', 'head', '{layer}.q_proj', ...), as a function that
    makes it (float32, dequantized), so `draft_sha256` can hold one at a time. A tied head is the embedding's; a
    distilled draft's is its trimmed `head` (the embedding stays the whole vocabulary's, for the lookup)."""
    inner = text_model(model).model
    dense = lambda layer: lambda: _dense(layer, copy)  # noqa: E731
    plain = lambda a: lambda: _np(a, copy)  # noqa: E731
    src: dict[str, Callable[[], np.ndarray]] = {"embed": dense(inner.embed_tokens)}
    for i, layer in enumerate(inner.layers):
        a, m = layer.self_attn, layer.mlp
        for block, names in ((a, ("q_proj", "k_proj", "v_proj", "o_proj")), (m, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                lin = getattr(block, n)
                src[f"{i}.{n}"] = dense(lin)
                if "bias" in lin:
                    src[f"{i}.{n}.bias"] = plain(lin.bias)
        for n in ("q_norm", "k_norm"):
            if hasattr(a, n):
                src[f"{i}.{n}"] = plain(getattr(a, n).weight)
        src[f"{i}.input_norm"] = plain(layer.input_layernorm.weight)
        src[f"{i}.post_norm"] = plain(layer.post_attention_layernorm.weight)
    src["norm"] = plain(inner.norm.weight)
    if hasattr(model, "stream_embeddings"):  # SS draft
        src["stream_embeddings"] = plain(model.stream_embeddings)
    head = None if _tied(model) else model.head if model_kept_ids(model) is not None else model.lm_head
    src["head"] = src["embed"] if head is None else dense(head)
    return src


def _tied(model: "nn.Module") -> bool:
    if model_kept_ids(model) is not None:
        return False
    return getattr(model, "lm_head", None) is None or bool(getattr(model.args, "tie_word_embeddings", False))


def model_kept_ids(model: "nn.Module") -> "np.ndarray | None":
    """A distilled draft's kept ids (its head's rows stand for them), or None for a whole-vocabulary head."""
    kept = getattr(model, "kept_ids", None)
    return None if kept is None else np.array(kept, dtype=np.int64)


def draft_sha256(model: "nn.Module") -> str:
    """The spec's `draft_sha256` of a loaded draft, one weight in memory at a time (a 0.6B draft's
    float32 weights are 2.4 GB)."""
    return _weights_sha256(_weight_sources(model, copy=False))


def spec_from_model(model: "nn.Module", config: dict, tok_sha: str, positions: int) -> DraftSpec:
    """DraftSpec of a loaded mlx-lm llama/mistral/qwen2/qwen3 model, SS draft or distilled draft."""
    inner = text_model(model).model
    args = model.args
    layer_types = getattr(args, "layer_types", []) or []
    if getattr(args, "sliding_window", None) and any(t != "full_attention" for t in layer_types):
        raise ConvertError("sliding-window attention layers are not supported in the Core ML draft")
    attn0 = inner.layers[0].self_attn
    heads, kv_heads = attn0.n_heads, attn0.n_kv_heads
    src, tied = _weight_sources(model), _tied(model)
    w = {k: make() for k, make in src.items() if not (tied and k == "head")}
    if tied:
        w["head"] = w["embed"]
    head_dim = w["0.q_proj"].shape[0] // heads
    streams = stream_layers = 0
    if hasattr(model, "stream_embeddings"):  # SS draft
        streams, stream_layers = int(args.num_streams), int(args.stream_layers)
    cos, sin = _rope_table(attn0.rope, head_dim, positions)
    kept = model_kept_ids(model)
    if kept is not None and (kept.size != w["head"].shape[0] or (np.diff(kept) <= 0).any()
                             or not 0 <= kept.min() <= kept.max() < w["embed"].shape[0]):
        raise ConvertError(f"the draft's kept_ids are not {w['head'].shape[0]} ascending ids below its vocabulary "
                           f"of {w['embed'].shape[0]:,}, one per head row: rebuild the distilled draft")
    return DraftSpec(
        model_type=config.get("model_type", args.model_type), hidden=w["embed"].shape[1],
        layers=len(inner.layers), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        vocab=w["head"].shape[0], eps=float(inner.norm.eps), weights=w, cos=cos, sin=sin,
        config=config, tokenizer_sha256=tok_sha, draft_sha256=_weights_sha256(w),
        streams=streams, stream_layers=stream_layers, tied=tied, kept_ids=kept,
    )


# --------------------------------------------------------------------------- quantization


def _kmeans_lut(nbits: int) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """1-D k-means (Lloyd, quantile init): a LUT per weight group without scikit-learn, memoised (both
    functions hold the same weights; equal LUTs keep them shared). Each cluster is a run of the sorted
    values, so a Lloyd step is a `searchsorted` of k-1 midpoints, not an n x k distance table."""
    memo: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}

    def fn(val: np.ndarray):
        key = hashlib.sha1(np.ascontiguousarray(val).tobytes()).digest()
        if key not in memo:
            memo[key] = cluster(val)
        return memo[key]

    def cluster(val: np.ndarray):
        x = np.asarray(val, np.float32).ravel()
        k, n = 1 << nbits, x.size
        s = np.sort(x)
        prefix = np.concatenate([[0.0], np.cumsum(s, dtype=np.float64)])
        c = s[((np.arange(k) + 0.5) * n / k).astype(np.int64)].astype(np.float64)
        for _ in range(12):
            ends = np.concatenate([[0], np.searchsorted(s, (c[:-1] + c[1:]) / 2), [n]])
            cnt = np.diff(ends)
            new = np.sort(np.where(cnt > 0, (prefix[ends[1:]] - prefix[ends[:-1]]) / np.maximum(cnt, 1), c))
            if np.array_equal(new, c):
                break
            c = new
        idx = np.searchsorted((c[:-1] + c[1:]) / 2, x)  # nearest centre
        return c.astype(val.dtype), idx.astype(np.uint8)

    return fn


def _compression_pass(mode: str, shared: tuple[str, ...] = ()) -> "AbstractGraphPass":
    """The coremltools compression pass for `mode` (int8 per channel, or a k-means LUT per 16 output
    channels) of the convs: a separate embedding stays fp16, as in Anemll. `shared`: the head's consts
    when the tied embedding lookup reads them too (a const feeding a conv and a gather has no op type)."""
    import coremltools.optimize.coreml as cto  # (coremltools: an extra off macOS)
    from coremltools.optimize.coreml._quantization_passes import (  # (coremltools: an extra off macOS)
        linear_quantize_weights, palettize_weights)

    if mode == "int8":
        cfg = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel")
        make = linear_quantize_weights
    else:
        cfg = cto.OpPalettizerConfig(mode="custom", lut_function=_kmeans_lut({"lut4": 4, "lut6": 6}[mode]),
                                     granularity="per_grouped_channel", group_size=16)
        make = palettize_weights
    return make(cto.OptimizationConfig(op_type_configs={"conv": cfg}, op_name_configs=dict.fromkeys(shared, cfg)))


def _share_weights(prog: "Program") -> None:
    """Give equal consts of the two functions one weight_id, so the package stores them once: by a hash
    of their bytes (both are built from the same arrays), not coremltools' float64 np.allclose of every
    candidate pair, which was most of a 0.6B draft's build time."""
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY  # (coremltools: an extra off macOS)

    PASS_REGISTRY["common::const_deduplication"].apply(prog)  # within each function first
    groups: dict[tuple, list] = {}
    for f in prog.functions.values():
        for op in f.operations:
            val = op.outputs[0].val if op.op_type == "const" else None
            if isinstance(val, np.ndarray):
                key = (val.dtype.str, val.shape, hashlib.sha1(np.ascontiguousarray(val).view(np.uint8).data).digest())
                groups.setdefault(key, []).append(op)
    for i, ops in enumerate(g for g in groups.values() if len(g) > 1):
        for op in ops:
            op.weight_id = str(i)


def _register_finish_pass() -> str:
    """A last graph pass: compress weights, then let both functions share every weight blob."""
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass  # (coremltools: an extra off macOS)
    from coremltools.converters.mil.mil.passes.pass_registry import (  # (coremltools: an extra off macOS)
        PASS_REGISTRY, register_pass)

    name = "mirror_mlx::finish"
    if name not in PASS_REGISTRY:

        @register_pass(namespace="mirror_mlx")
        class finish(AbstractGraphPass):  # noqa: N801  (coremltools names passes in lower case)
            quantize = "none"
            shared = ""  # comma-separated const names (PassOption values are strings)

            def apply(self, prog):
                if self.quantize != "none":
                    _compression_pass(self.quantize, tuple(filter(None, self.shared.split(",")))).apply(prog)
                _share_weights(prog)

    return name


# --------------------------------------------------------------------------- package


def metadata(spec: DraftSpec, shapes: Shapes, quantize: str) -> dict[str, str]:
    """What the runtime checks before trusting a package (all strings, as Core ML wants)."""
    vocab = spec.vocab if spec.kept_ids is None else spec.weights["embed"].shape[0]  # the ids the engine sees
    meta = {
        "format": FORMAT, "kind": "ss" if spec.streams else "plain", "model_type": spec.model_type,
        "config": json.dumps(spec.config, sort_keys=True),
        "draft_sha256": spec.draft_sha256, "tokenizer_sha256": spec.tokenizer_sha256,
        "vocab": str(vocab), "layers": str(spec.layers), "kv_heads": str(spec.kv_heads),
        "head_dim": str(spec.head_dim), "logit_outputs": str(len(head_names(spec))), "quantize": quantize,
        "compute_units": "CPU_AND_NE", "stream_layers": str(spec.stream_layers),
    }
    if spec.kept_ids is not None:  # a trimmed head: its V logit columns stand for these ids
        meta["kept_ids"] = kept_ids_metadata(spec.kept_ids, vocab)
    meta.update(spec.tokenizer_meta)
    meta.update({k: str(v) for k, v in asdict(shapes).items()})
    return {META + k: v for k, v in meta.items()}


def convert(draft: Path, out: Path, context: int = 512, kappa: int = PAPER_KNOBS["kappa"],
            gamma: int = PAPER_KNOBS["gamma"], chunk: int = 16, quantize: str = "none", progress: bool = True) -> Path:
    """Build `out` (.mlpackage) from the mlx-lm draft folder `draft`: both functions into one program,
    converted once (passes, compression, weight sharing) and saved with the metadata."""
    if quantize not in QUANTIZE:
        raise ConvertError(f"--quantize must be one of {', '.join(QUANTIZE)} (got {quantize!r})")
    ct = import_coremltools()  # before any work: off macOS it is an extra
    from coremltools.converters.mil.mil import Program  # (coremltools: an extra off macOS)

    config = Path(draft) / "config.json"
    streams = int(json.loads(config.read_text()).get("num_streams", 0) or 0) if config.is_file() else 0
    shapes = Shapes.make(context, kappa, gamma, chunk, streams)
    spec = read_draft(Path(draft), positions=shapes.slots)
    out = Path(out)
    if out.suffix != ".mlpackage":
        raise ConvertError(f"--out must end in .mlpackage (got {out.name})")
    bar = tqdm(total=2 * spec.layers + 3, desc=f"convert {out.name}", unit="step", disable=not progress)
    prog = Program()
    for fn in ("extend", "rollout"):
        bar.set_postfix_str(f"build {fn}")
        prog.add_function(fn, build_function(spec, shapes, fn, progress=lambda: bar.update(1)))
    prog.default_function_name = "rollout"
    prog.export_as_multifunction = True
    pipeline = ct.PassPipeline.DEFAULT
    finish = _register_finish_pass()
    pipeline.append_pass(finish)
    shared = ",".join(head_names(spec)) if spec.tied else ""
    pipeline.set_options(finish, {"quantize": quantize, "shared": shared})
    bar.set_postfix_str("convert" + ("" if quantize == "none" else f" + {quantize}"))
    with quiet_coremltools():
        model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                           compute_units=ct.ComputeUnit.CPU_AND_NE, compute_precision=ct.precision.FLOAT16,
                           pass_pipeline=pipeline, skip_model_load=True)
    bar.update(2)
    bar.set_postfix_str("save")
    kind = f"Speculative-Streaming ({spec.streams} streams)" if spec.streams else "plain"
    model.short_description = f"mirror-mlx {kind} draft ({spec.model_type}) for the Neural Engine"
    model.user_defined_metadata.update(metadata(spec, shapes, quantize))
    if out.exists():
        shutil.rmtree(out)
    model.save(str(out))
    bar.update(1)
    bar.close()
    return out


def check_match(meta: dict[str, str], spec: "DraftSpec | SimpleNamespace", package: Path) -> None:
    """Refuse a package built from another draft, tokenizer or set of kept ids (`spec`: a DraftSpec, or anything
    with its tokenizer_sha256, draft_sha256 and kept_ids: None for a whole-vocabulary head)."""
    mine, theirs = read_kept_ids(meta), getattr(spec, "kept_ids", None)
    same_kept = mine is theirs if mine is None or theirs is None else np.array_equal(mine, theirs)
    for same, what in ((meta["tokenizer_sha256"] == spec.tokenizer_sha256, "for another tokenizer than this draft's"),
                       (same_kept, f"with other kept ids ({_count(mine)}) than this draft's ({_count(theirs)})"),
                       (meta["draft_sha256"] == spec.draft_sha256, "from different draft weights than this folder's")):
        if not same:
            raise ConvertError(f"{package} was built {what}; rebuild it from this draft with `mirror-mlx convert`")


def _count(kept: "np.ndarray | None") -> str:
    return "the whole vocabulary" if kept is None else f"{kept.size:,} ids"
