"""Widening keeps the function: same logits, same greedy text, the new shape's parameter count."""

import json
import math
from contextlib import contextmanager

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from mlx_lm import generate, load
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import _get_classes

from mirror_mlx.cli import main
from mirror_mlx.convert.widen import Shape, WidenError, check_shape, head_layout, widen_weights, widened_config
from mirror_mlx.convert.widen import exact_exit_layers
from mirror_mlx.engine.exit_adapter import check_layer, load_adapter
from mirror_mlx.demo import EXIT_ADAPTER as DEMO_EXIT_ADAPTER
from mirror_mlx.engine.target import EarlyExitTarget
from models import CONFIGS, TARGET_PATH, tiny_model

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"
SHAPE = ["--hidden", "256", "--heads", "32", "--kv-heads", "16", "--intermediate", "688", "--layers", "8"]


def param_count(config: dict) -> int:
    """Parameters of a llama/mistral/qwen2/qwen3 model with this config (no quantization)."""
    s = Shape.of(config)
    D, F, hd, q, kv = s.hidden, s.intermediate, s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim
    mt = config["model_type"]
    layer = 2 * D + 2 * D * q + 2 * D * kv + 3 * D * F
    if mt == "qwen2" or (mt in ("llama", "mistral") and config.get("attention_bias")):
        layer += q + 2 * kv
    if mt in ("llama", "mistral") and config.get("attention_bias"):
        layer += D
    if mt in ("llama", "mistral") and config.get("mlp_bias"):
        layer += 2 * F + D
    if mt == "qwen3":
        layer += 2 * hd
    V = config["vocab_size"]
    head = 0 if config.get("tie_word_embeddings", True) else V * D
    return V * D + D + head + s.layers * layer


def widened(tmp_path_factory, source, shape):
    """`mirror-mlx widen` of `source` to `shape`, into a fresh folder."""
    out = tmp_path_factory.mktemp("wide") / "widened"
    r = CliRunner().invoke(main, ["widen", "--model", str(source), "--out", str(out), *shape])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = widened(tmp_path_factory, TARGET_PATH, SHAPE)
    model, tok = load(str(TARGET_PATH))
    wide, wide_tok = load(str(out))
    return model, tok, wide, wide_tok, out


def float32_tolerance(logits: mx.array, layers: int, width: int) -> float:
    """How far two float32 evaluations of one function may drift apart when they sum in another order.

    Another BLAS kernel or thread count reorders each dot product's sums. Rounding errors of u = 2^-24 per
    operation then add like a random walk over a dot product's terms (√width · u relative, Higham's
    probabilistic bound), once per block of the residual stream, relative to the logits' magnitude; ×2 for
    the two evaluations. That the function itself is the same is checked in float64, where it is exact.
    """
    return 2 * layers * math.sqrt(width) * 2.0**-24 * mx.abs(logits).max().item()


@contextmanager
def float64(*models):
    """The models in float64 (on the CPU stream, where MLX has it), float32 again after."""
    with mx.stream(mx.cpu):
        for m in models:
            m.set_dtype(mx.float64)
        try:
            yield
        finally:
            for m in models:
                m.set_dtype(mx.float32)


def decode_gap(model, wide, ids: list[int], extra: int = 0) -> tuple[float, mx.array]:
    """Feed `ids` token by token through KV caches (the decode regime), then `extra` of the model's own greedy
    tokens: the largest logit difference between the two models, and the last logits."""
    ca, cb = [KVCache() for _ in model.layers], [KVCache() for _ in wide.layers]
    worst, y = 0.0, ids[0]
    for t in range(len(ids) + extra):
        a, b = model(mx.array([[y]]), cache=ca), wide(mx.array([[y]]), cache=cb)
        assert a.dtype == b.dtype
        worst = max(worst, mx.abs(a - b).max().item())
        y = ids[t + 1] if t + 1 < len(ids) else mx.argmax(a[0, -1]).item()
    return worst, a


def n_params(model) -> int:
    return sum(x.size for _, x in tree_flatten(model.parameters()))


def test_config_and_files(pair):
    _, _, wide, _, out = pair
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (256, 32, 16)
    assert (cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (688, 8, 8)
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5 * 64 / 256)
    assert {"tokenizer.json", "tokenizer.model", "tokenizer_config.json"} <= {f.name for f in out.iterdir()}
    assert len(wide.layers) == 8


def test_decode_logits_equal_float32(pair):
    """Token by token through KV caches (the decode regime): exact in float64; in float32 the logits differ only
    by summation order (within `float32_tolerance`)."""
    model, tok, wide, _, _ = pair
    ids = tok.encode(PROMPT)
    worst, logits = decode_gap(model, wide, ids, extra=24)  # the prompt, then the model's own greedy continuation
    assert logits.dtype == mx.float32 and mx.abs(logits).max().item() > 5  # real logits, not a degenerate model
    assert worst <= float32_tolerance(logits, layers=8, width=256)
    with float64(model, wide):
        assert decode_gap(model, wide, ids, extra=24)[0] <= 1e-10


def test_prefill_logits_equal(pair):
    """The whole prompt in one forward: exact in float64; float32 differs only by BLAS summation order.

    OpenBLAS picks a different small-matrix kernel when a projection's output width changes (for
    8..16 rows), which reorders sums (measured 1.8e-5 on logits of magnitude ~20).
    """
    model, tok, wide, _, _ = pair
    ids = mx.array([tok.encode(PROMPT)])
    a, b = model(ids), wide(ids)
    assert mx.abs(a).max().item() > 5  # real logits, not a degenerate model
    assert mx.abs(a - b).max().item() <= float32_tolerance(a, layers=8, width=256)
    with float64(model, wide):
        assert mx.abs(model(ids) - wide(ids)).max().item() <= 1e-10


def test_greedy_text_identical(pair):
    model, tok, wide, wide_tok, _ = pair
    a = generate(model, tok, PROMPT, max_tokens=40)
    b = generate(wide, wide_tok, PROMPT, max_tokens=40)
    assert len(a.split()) >= 10
    assert a == b


def test_inexact_ratio_decode_float32(tmp_path):
    """Width × 3 (√(1/3) rounds in float32, an error of u per norm, inside the summation-order bound): decode
    logits still agree closely, greedy text is the same."""
    out = tmp_path / "w3"
    r = CliRunner().invoke(main, ["widen", "--model", str(TARGET_PATH), "--out", str(out), "--hidden", "192",
                                  "--heads", "24", "--intermediate", "516", "--layers", "7"])
    assert r.exit_code == 0, r.output
    (model, tok), (wide, _) = load(str(TARGET_PATH)), load(str(out))
    worst, logits = decode_gap(model, wide, tok.encode(PROMPT))
    assert worst <= float32_tolerance(logits, layers=7, width=192)
    assert generate(model, tok, PROMPT, max_tokens=40) == generate(wide, tok, PROMPT, max_tokens=40)


def test_parameter_count_is_the_new_shape(pair):
    model, _, wide, _, out = pair
    old_cfg = json.loads((TARGET_PATH / "config.json").read_text())
    new_cfg = json.loads((out / "config.json").read_text())
    assert n_params(model) == param_count(old_cfg)
    assert n_params(wide) == param_count(new_cfg) == 5_935_360


@pytest.mark.parametrize("name,hidden,heads,kv", [
    ("llama_untied", 256, 8, 4),   # heads × head_dim ≠ hidden is fine for llama
    ("llama_tied", 256, 8, 8),     # smaller GQA group: kv heads are duplicated
    ("mistral", 256, 12, 3),       # larger GQA group
    ("qwen2", 256, 16, 8),         # q/k/v biases
    ("qwen3", 256, 8, 8),          # per-head q/k norms
])
def test_families_exact(name, hidden, heads, kv):
    """In float64 the logits are the same to rounding.

    d/D = 1/4 keeps √(d/D) exact: mx.fast.rms_norm computes in float32 even for float64 inputs,
    so an inexact scale would show up as 1e-7 noise (that case is covered in float32 below).
    """
    cfg = dict(CONFIGS[name])
    new = Shape(hidden, heads, kv, 160, 7, Shape.of(cfg).head_dim)
    wcfg = widened_config(cfg, new)
    if wcfg["model_type"] == "mistral":
        wcfg["model_type"] = "llama"
    model_cls, args_cls = _get_classes(wcfg)
    ids = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]])
    with mx.stream(mx.cpu):
        model = tiny_model(name)
        model.set_dtype(mx.float64)
        wide = model_cls(args_cls.from_dict(wcfg))
        wide.load_weights(list(widen_weights(dict(tree_flatten(model.parameters())), cfg, new).items()))
        assert n_params(model) == param_count(cfg)
        assert n_params(wide) == param_count(widened_config(cfg, new))
        a, b = model(ids), wide(ids)
        assert a.dtype == b.dtype == mx.float64 and mx.abs(a).max().item() > 1e-3
        assert mx.abs(a - b).max().item() <= 1e-10


def test_head_layout_keeps_groups():
    for h, k, H, K in [(8, 4, 32, 16), (8, 4, 16, 16), (8, 2, 24, 4), (4, 4, 8, 8)]:
        q_pos, kv_src = head_layout(h, k, H, K)
        assert len(set(q_pos)) == h and max(q_pos) < H
        for i, p in enumerate(q_pos):
            assert kv_src[p // (H // K)] == i // (h // k)


@pytest.mark.parametrize("args,words", [
    (["--hidden", "32", "--heads", "8", "--intermediate", "172", "--layers", "5"], "smaller"),
    (["--hidden", "64", "--heads", "8", "--intermediate", "172", "--layers", "4"], "smaller"),
    (["--hidden", "128", "--heads", "12", "--kv-heads", "5", "--intermediate", "200", "--layers", "5"],
     "not a multiple"),
    (["--hidden", "128", "--heads", "9", "--intermediate", "200", "--layers", "5"], "--kv-heads"),
])
def test_bad_shapes_are_usage_errors(tmp_path, args, words):
    r = CliRunner().invoke(main, ["widen", "--model", str(TARGET_PATH), "--out", str(tmp_path / "o"), *args])
    assert r.exit_code == 2 and words in r.output, r.output
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_grouping_that_cannot_be_kept():
    cfg = dict(CONFIGS["llama_tied"], num_attention_heads=12, num_key_value_heads=4, head_dim=8, hidden_size=96)
    check_shape(cfg, Shape(96, 16, 8, 96, 4, 8))  # groups of 3 → 2 kv heads each: fits
    with pytest.raises(WidenError, match="cannot serve"):
        check_shape(cfg, Shape(112, 14, 7, 96, 4, 8))  # groups of 3 → 2 kv heads each: 8 > 7


def test_unsupported_model_type(tmp_path):
    src = tmp_path / "g"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(dict(CONFIGS["gemma3_text"])))
    r = CliRunner().invoke(main, ["widen", "--model", str(src), "--out", str(tmp_path / "o"), "--hidden", "128",
                                  "--heads", "8", "--intermediate", "200", "--layers", "8"])
    assert r.exit_code == 2 and "not supported" in r.output, r.output


def test_exact_exit_layers_follow_the_original_block():
    assert exact_exit_layers(2, 5, 15) == [4, 5, 6]  # the bench target: block 1 at slot 3, identities 4, 5
    assert exact_exit_layers(2, 5, 8) == [2, 3]
    assert exact_exit_layers(5, 5, 15) == [13, 14, 15]


def widened_exit(widened_model, out_file):
    """`mirror-mlx widen-exit` of the demo's exit adapter to `widened_model`: its output."""
    r = CliRunner().invoke(main, ["widen-exit", "--exit-adapter", str(DEMO_EXIT_ADAPTER), "--model", str(TARGET_PATH),
                                  "--widened", str(widened_model), "--out", str(out_file)])
    assert r.exit_code == 0, r.output
    return r.output


def test_widened_exit_adapter_gives_the_small_pairs_early_logits(pair, tmp_path):
    """A widened adapter is exact: at every layer holding the original exit state, same early logits."""
    model, tok, wide, _, out = pair
    adapter_out = tmp_path / "wide_exit.safetensors"
    assert "exact at exit layers 2, 3" in widened_exit(out, adapter_out)
    tokens = mx.array([tok.encode(PROMPT)])
    small = EarlyExitTarget(model, 2, load_adapter(DEMO_EXIT_ADAPTER, model, 2))
    want = small.forward(tokens, cache=None)[0]
    bare = EarlyExitTarget(model, 2).forward(tokens, cache=None)[0]
    assert mx.abs(want - bare).max().item() > 0.1, "the adapter must matter for this test to mean anything"
    small.remove()
    adapter = load_adapter(adapter_out, wide)
    for layer in (2, 3):
        check_layer(adapter, layer)
        target = EarlyExitTarget(wide, layer, adapter)
        got = target.forward(tokens, cache=None)[0]
        target.remove()
        assert mx.abs(got - want).max().item() <= 1e-4
    with pytest.raises(ValueError, match="exit layer"):
        check_layer(adapter, 4)  # after the next original block: another state, another adapter


def test_widen_exit_refuses_an_adapter_of_another_model(pair, tmp_path):
    *_, out = pair
    r = CliRunner().invoke(main, ["widen-exit", "--exit-adapter", str(DEMO_EXIT_ADAPTER), "--model", str(out),
                                  "--widened", str(out), "--out", str(tmp_path / "x.safetensors")])
    assert r.exit_code == 2 and "another model" in r.output


def test_one_adapter_per_exit_layer_and_the_engine_takes_the_one_for_its_layer(pair, tmp_path):
    """`--exit-adapter a,b`: a widened adapter (exact at 2, 3) and one for layer 5; ℓ_e picks its own."""
    from mirror_mlx.engine.exit_adapter import ExitAdapter, adapter_for, adapter_meta, load_adapters, save_adapter
    from mirror_mlx.engine.target import TargetSide

    model, _, wide, _, out = pair
    a = tmp_path / "exit2.safetensors"
    widened_exit(out, a)
    b = tmp_path / "exit5.safetensors"
    save_adapter(b, ExitAdapter(256, 8), adapter_meta(wide, 5))
    both = load_adapters(f"{a},{b}", wide)
    assert both.exit_layers == (2, 3, 5) and both.exit_layer == 3
    for layer in (2, 3, 5):
        check_layer(both, layer)
    with pytest.raises(ValueError, match="exit layer"):
        check_layer(both, 4)
    side = TargetSide(wide)
    for layer, want in ((3, both.for_layer(2)), (5, both.for_layer(5))):
        side.set_exit_layer(layer, adapter_for(both, layer))
        assert side.tapped.adapter is want
    side.tapped.remove()
    with pytest.raises(ValueError, match="two exit adapters"):
        load_adapters(f"{a},{a}", wide)


SS_SHAPE = ["--hidden", "256", "--heads", "32", "--kv-heads", "16", "--intermediate", "768", "--layers", "10"]


@pytest.fixture(scope="module")
def ss_pair(tmp_path_factory):
    from mirror_mlx.drafts.ss.model import load_ss_draft
    from mirror_mlx.demo import SS_DRAFT

    out = widened(tmp_path_factory, SS_DRAFT, SS_SHAPE)
    return load_ss_draft(SS_DRAFT)[0], load_ss_draft(out, with_tokenizer=False)[0], out


def test_ss_draft_widens_with_its_stream_layers_on_top(ss_pair):
    """The original spawn block (3 of 5) sits at layer 6 of 10, so layers 6..9 carry stream rows."""
    model, wide, out = ss_pair
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "ss_llama" and cfg["num_streams"] == model.args.num_streams == 3
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["stream_layers"]) == (256, 10, 4)
    assert model.args.stream_layers == 2 and len(model.layers) == 5
    assert wide.stream_embeddings.shape == (3, 256)
    assert mx.abs(wide.stream_embeddings[:, 64:]).max().item() == 0


def ss_decode_gap(model, wide, ids: list[int]) -> tuple[float, mx.array]:
    """Feed `ids` token by token over the committed past: the largest difference of main and stream rows'
    logits between the two SS drafts, and the last stream logits."""
    from mirror_mlx.drafts.ss.model import ss_forward

    past_a = past_b = None
    worst = 0.0
    for t, y in enumerate(ids):
        x = mx.array([[y]])
        a = ss_forward(model, x, offset=t, past=past_a)
        b = ss_forward(wide, x, offset=t, past=past_b)
        assert a.main.dtype == b.main.dtype and b.streams.shape == (1, 3, 1, 512)
        worst = max(worst, mx.abs(a.main - b.main).max().item(), mx.abs(a.streams - b.streams).max().item())
        past_a = [(mx.concatenate([k, nk], 2), mx.concatenate([v, nv], 2)) for (k, v), (nk, nv) in zip(past_a, a.kv)] if past_a else a.kv
        past_b = [(mx.concatenate([k, nk], 2), mx.concatenate([v, nv], 2)) for (k, v), (nk, nv) in zip(past_b, b.kv)] if past_b else b.kv
    return worst, a.streams


def test_ss_draft_decode_logits_equal_float32(ss_pair):
    """Token by token over the committed past (the decode regime): exact in float64; in float32 main and stream
    rows' logits differ only by summation order (within `float32_tolerance`)."""
    model, wide, _ = ss_pair
    ids = load(str(TARGET_PATH))[1].encode(PROMPT)
    worst, streams = ss_decode_gap(model, wide, ids)
    assert streams.dtype == mx.float32 and mx.abs(streams).max().item() > 5  # real logits, not a degenerate model
    assert worst <= float32_tolerance(streams, layers=10, width=256)
    with float64(model, wide):
        assert ss_decode_gap(model, wide, ids)[0] <= 1e-10


def test_ss_draft_many_row_logits_exact(ss_pair):
    """A prompt in one forward, then a few rows after it (a rollout's shape): exact in float64.

    In float32 OpenBLAS picks another small-matrix kernel for the wider projections, which reorders
    sums (as for the plain prefill above; measured up to 1.1e-4 on stream logits of magnitude ~17).
    """
    from mirror_mlx.drafts.ss.model import ss_forward

    model, wide, _ = ss_pair
    ids = load(str(TARGET_PATH))[1].encode(PROMPT)
    head, tail = mx.array([ids[:-4]]), mx.array([ids[-4:]])

    def gap() -> tuple[float, mx.array]:
        a, b = ss_forward(model, head), ss_forward(wide, head)
        a2 = ss_forward(model, tail, offset=head.shape[1], past=a.kv)
        b2 = ss_forward(wide, tail, offset=head.shape[1], past=b.kv)
        assert a.streams.shape == b.streams.shape == (1, 3, head.shape[1], 512)
        return max(mx.abs(x - y).max().item() for x, y in
                   ((a.main, b.main), (a.streams, b.streams), (a2.main, b2.main), (a2.streams, b2.streams))), a.streams

    worst, streams = gap()
    assert worst <= float32_tolerance(streams, layers=10, width=256)
    with float64(model, wide):
        assert gap()[0] <= 1e-10


def test_ss_draft_greedy_rollouts_identical(ss_pair):
    """Branched SS rollouts (stream guesses trusted, so stream rows shape the windows) are the same:
    windows, forwards, and tokens gained per forward."""
    from mirror_mlx.drafts.ss.draft import SSDraft

    model, wide, _ = ss_pair
    tok = load(str(TARGET_PATH))[1]
    context = tok.encode(PROMPT)
    small, big = SSDraft(model), SSDraft(wide)
    gained = []
    for step in range(4):
        stems = [[context[-1] if step else 7], [11, 12], [30]]
        a, b = small.rollout(context, stems, gamma=6), big.rollout(context, stems, gamma=6)
        assert (a.windows, a.forwards) == (b.windows, b.forwards)
        assert small.stats.emitted == big.stats.emitted
        gained += [n for per in small.stats.emitted for n in per]
        context = context + a.windows[0][:3]
    assert max(gained) > 1, "stream guesses must have been accepted for this test to cover stream rows"
