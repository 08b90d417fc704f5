"""`mirror-mlx convert`: the Core ML package's spec, ops, and parity with the MLX draft (on Linux).

Packages are converted once per module with small shapes (context 64, kappa 2, gamma 3) to keep
the file fast on two cores; the parity checks evaluate the *saved* packages' MIL programs.
"""

import json
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, load, save_config, save_model

from mirror_mlx.ane_draft.package_host import PackageDraft
from mirror_mlx.convert import coreml, mil_eval, mil_graph
from ane_ops import FOLDED, NATIVE

ANE_OPS = set(NATIVE) | set(FOLDED)  # every op the Neural Engine runs (or folds into weights)
from mirror_mlx.ane_draft.package_format import ConvertError, read_metadata, tokenizer_sha256
from mirror_mlx.convert.coreml import convert
from mirror_mlx.convert.mil_eval import MilRunner, load_program
from mirror_mlx.convert.parity import PROMPTS, verify
from mirror_mlx.demo import DRAFT as DEMO_DRAFT
from mirror_mlx.demo import TARGET as DEMO_TARGET
from tests.models import PERIOD, swapped_vocab, with_config
from tests.support import greedy_uncached

SMALL = dict(context=64, kappa=2, gamma=3, chunk=8)
TINY = dict(hidden_size=64, num_hidden_layers=1, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512, head_dim=16,
            max_position_embeddings=512, rope_theta=10000.0)
FAMILIES = {
    "llama": dict(TINY, model_type="llama", tie_word_embeddings=True),
    # q/k/v biases; 513 rows: transformers loads the demo tokenizer in a qwen2 folder as a
    # Qwen2Tokenizer, which adds <|endoftext|> as id 512 (convert refuses ids past the vocabulary)
    "qwen2": dict(TINY, model_type="qwen2", tie_word_embeddings=True, vocab_size=513),
    "qwen3": dict(TINY, model_type="qwen3", tie_word_embeddings=False),  # q/k norms, own head
}


def op_types(program) -> set[str]:
    """Every op type used by every function of a program."""
    return {op.op_type for f in program.functions.values() for op in f.operations}


def make_draft(root: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A tiny random mlx-lm model of `family` saved as a folder, with the demo tokenizer."""
    config = dict(FAMILIES[family], **overrides)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # random biases and norm weights, so those code paths are really exercised
    params = [(n, 1.0 + 0.2 * mx.random.normal(p.shape)) for n, p in tree_flatten(model.parameters())
              if n.endswith("norm.weight")]
    params += [(n, 0.1 * mx.random.normal(p.shape)) for n, p in tree_flatten(model.parameters()) if n.endswith("bias")]
    model.load_weights(params, strict=False)
    mx.eval(model.parameters())
    out = root / "-".join([family, str(seed)] + [f"{k}{v}" for k, v in overrides.items()])
    save_model(out, model)
    save_config(config, out / "config.json")
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(DEMO_DRAFT / f, out / f)
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("coreml")


@pytest.fixture(scope="module")
def demo_pkg(work):
    return convert(DEMO_DRAFT, work / "llama2xs.mlpackage", progress=False, **SMALL)


@pytest.fixture(scope="module")
def tiny_llama(work):
    return make_draft(work, "llama")


_PACKAGES: dict[str, tuple[Path, Path]] = {}


def family_package(work: Path, family: str) -> tuple[Path, Path]:
    """(draft folder, package) of a tiny random `family` model, converted once per module."""
    if family not in _PACKAGES:
        draft = make_draft(work, family)
        pkg = convert(draft, work / f"{family}.mlpackage", progress=False, context=64, kappa=1, gamma=2, chunk=8)
        _PACKAGES[family] = (draft, pkg)
    return _PACKAGES[family]


@pytest.fixture(scope="module")
def demo_model():
    return load(str(DEMO_DRAFT))


def scale_fp16_blobs(blob: Path, factor: float) -> int:
    """Scale every other fp16 blob of a Core ML weight file in place; returns how many."""
    raw = bytearray(blob.read_bytes())
    count, pos, done = struct.unpack_from("<I", raw, 0)[0], 64, 0
    for i in range(count):
        sentinel, dtype, size, offset = struct.unpack_from("<IIQQ", raw, pos)
        assert sentinel == 0xDEADBEEF
        if i % 2 == 1 and dtype == 1:  # 1: float16
            data = np.frombuffer(bytes(raw[offset : offset + size]), np.float16) * factor
            raw[offset : offset + size] = data.astype(np.float16).tobytes()
            done += 1
        pos = (offset + size + 63) // 64 * 64
    blob.write_bytes(bytes(raw))
    return done


# ------------------------------------------------------------------ the package


def test_spec_has_two_functions_state_fp16_io_and_metadata(demo_pkg, demo_model):
    import coremltools as ct

    spec = ct.utils.load_spec(str(demo_pkg))
    funcs = {f.name: f for f in spec.description.functions}
    assert set(funcs) == {"extend", "rollout"}
    FP16, INT32 = ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT16, ct.proto.FeatureTypes_pb2.ArrayFeatureType.INT32
    S, E, B, W = 64, 8, 2 * 4, 2 * 4 * 4
    for name, T, keys in (("extend", E, S + E), ("rollout", B, S + W + B)):
        f = funcs[name]
        (state,) = f.state
        assert state.name == "kv_cache"
        assert list(state.type.stateType.arrayType.shape) == [2 * 5, 4, 8, S + W]  # (2L, kv, d, K)
        assert state.type.stateType.arrayType.dataType == FP16
        ins = {i.name: i.type.multiArrayType for i in f.input}
        assert list(ins["mask"].shape) == [1, keys, T] and ins["mask"].dataType == FP16
        assert list(ins["input_ids"].shape) == [1, T] and ins["input_ids"].dataType == INT32
        assert ins["positions"].dataType == ins["write_pos"].dataType == INT32
        (out,) = f.output
        assert out.name == "logits" and list(out.type.multiArrayType.shape) == [1, T, 512]
        assert out.type.multiArrayType.dataType == FP16
    meta = read_metadata(demo_pkg)
    assert (meta["kappa"], meta["gamma"], meta["context"], meta["rows"]) == ("2", "3", "64", "8")
    assert meta["tokenizer_sha256"] == tokenizer_sha256(demo_model[1])
    assert json.loads(meta["config"])["model_type"] == "llama"
    assert meta["compute_units"] == "CPU_AND_NE" and meta["quantize"] == "none"


def test_functions_share_one_copy_of_the_weights(demo_pkg, demo_model):
    n_params = sum(v.size for _, v in tree_flatten(demo_model[0].parameters()))  # tied: the table once
    blob = demo_pkg / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    table = 2 * 512 * 64
    # two unshared functions would be ~2x; a second copy of the tied table +table
    assert 2 * n_params <= blob.stat().st_size < 2 * n_params + table // 4


def test_every_op_is_on_the_ane_list(demo_pkg):
    ops = op_types(load_program(demo_pkg))
    assert {"conv", "layer_norm", "matmul", "softmax", "read_state", "coreml_update_state"} <= ops
    assert ops <= ANE_OPS and "band_part" not in ANE_OPS  # (the list is not everything)


# ------------------------------------------------------------------ parity on Linux


def test_verify_demo_draft_parity(demo_pkg, demo_model):
    report = verify(demo_pkg, DEMO_DRAFT, model=demo_model[0], tokenizer=demo_model[1])
    assert report.ok, report.line()
    assert report.extend_rows > 20 and report.rollout_rows > 100
    assert report.max_abs < 0.03 * report.scale + 0.05
    assert report.mismatches == 0


def test_rollout_equals_mlx_greedy_with_rollback_and_split(demo_pkg, demo_model):
    model, tok = demo_model
    draft = PackageDraft(MilRunner(demo_pkg), read_metadata(demo_pkg))
    ctx = tok.encode("Once upon a time, there was a little girl")
    stems = [[5], [6, 7], [6, 8], [6, 8], [9, 10, 11]]
    r = draft.rollout(ctx, stems, 3)
    assert r.windows == [greedy_uncached(model, ctx + s, 3) for s in stems]
    extends = -(-len(ctx) // draft.shapes.chunk)  # the fresh context, one `extend` call per chunk
    assert r.forwards == extends + 3  # then the trie (8 nodes) fits one call, then one call per token
    # the committed prefix diverges: rows past the common prefix are masked, not erased
    ctx2 = ctx[:-2] + [100, 200]
    r2 = draft.rollout(ctx2, [[7]], 3)
    assert r2.windows == [greedy_uncached(model, ctx2 + [7], 3)]
    # more long stems than the scratch slots hold: rolled out in groups, still exact
    many = [[t, t + 1, t + 2, t + 3] for t in range(20, 32)]
    r3 = draft.rollout(ctx2, many, 3)
    assert r3.windows == [greedy_uncached(model, ctx2 + s, 3) for s in many]
    assert r3.forwards > 4


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # llama: the demo draft above
def test_families_convert_and_pass_parity(work, family, monkeypatch):
    if family == "qwen3":  # also exercise the split LM head (logits_0..n) with a small split
        monkeypatch.setattr(mil_graph, "HEAD_SPLIT", 200)
    draft, pkg = family_package(work, family)
    assert read_metadata(pkg)["logit_outputs"] == ("3" if family == "qwen3" else "1")
    report = verify(pkg, draft, steps=2, prompts=PROMPTS[:1])
    assert report.ok, report.line()


@pytest.mark.parametrize("mode,op", [("int8", "constexpr_blockwise_shift_scale"), ("lut4", "constexpr_lut_to_dense")])
def test_quantized_packages_convert_and_report_parity(work, tiny_llama, mode, op):
    draft = tiny_llama
    pkg = convert(draft, work / f"llama-{mode}.mlpackage", progress=False, context=64, kappa=1, gamma=2,
                  chunk=8, quantize=mode)
    ops = op_types(load_program(pkg))
    assert op in ops and ops <= ANE_OPS
    assert read_metadata(pkg)["quantize"] == mode
    report = verify(pkg, draft, steps=2, prompts=PROMPTS[:1])
    print(report.line())
    assert report.ok, report.line()  # the looser, stated tolerance of this mode
    assert report.max_abs > 1e-3  # the weights really changed


def test_palettized_weights_are_looked_up_as_coremltools_expands_them(work, tiny_llama):
    """The evaluator's one-lookup expansion of a lut4 weight equals coremltools' own lut_to_dense, bit for
    bit (the parity tolerance of lut4 is loose; this is not)."""
    pkg = convert(tiny_llama, work / "llama-lut4-lookup.mlpackage", progress=False, context=64, kappa=1, gamma=2,
                  chunk=8, quantize="lut4")
    ops = [op for f in load_program(pkg).functions.values() for op in f.operations
           if op.op_type == "constexpr_lut_to_dense"]
    assert ops
    for op in ops:
        assert op.lut.val.shape[-1] == 1  # scalar palettes: the evaluator's fast path
        ours = mil_eval._lut_to_dense(op.indices.val, op.lut.val[..., 0])
        np.testing.assert_array_equal(ours, op.materialized_val_inference())


# ------------------------------------------------------------------ bad input


def unsupported_folder(work: Path) -> Path:
    """A model folder of an architecture convert does not build (each test makes its own: under
    pytest-xdist a module's tests may run in different workers)."""
    d = work / "gemma"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    return d


def test_unsupported_architecture_is_refused(work):
    d = unsupported_folder(work)
    with pytest.raises(ConvertError, match="'gemma3_text' is not supported.*llama, mistral, qwen2, qwen3"):
        convert(d, work / "gemma.mlpackage", progress=False, **SMALL)
    with pytest.raises(ConvertError, match="not an MLX model folder"):
        convert(work / "nowhere", work / "x.mlpackage", progress=False, **SMALL)


def test_bad_shapes_are_refused(work):
    with pytest.raises(ConvertError, match="--context 4 must be at least the extend chunk"):
        convert(DEMO_DRAFT, work / "x.mlpackage", progress=False, context=4, kappa=2, gamma=3, chunk=8)
    with pytest.raises(ConvertError, match="kappa and gamma must be >= 1"):
        convert(DEMO_DRAFT, work / "x.mlpackage", progress=False, context=64, kappa=0, gamma=3)
    with pytest.raises(ConvertError, match="--quantize must be one of"):
        convert(DEMO_DRAFT, work / "x.mlpackage", progress=False, quantize="int4")


def test_package_from_another_draft_or_tokenizer_is_refused(tiny_llama, demo_pkg, demo_model):
    with pytest.raises(ConvertError, match="different draft weights"):
        verify(demo_pkg, tiny_llama)
    from mirror_mlx.convert.coreml import check_match, spec_from_model

    meta = read_metadata(demo_pkg)
    spec = spec_from_model(demo_model[0], {}, "0" * 64, 200)
    with pytest.raises(ConvertError, match="another tokenizer"):
        check_match(meta, spec, demo_pkg)


def test_the_recipe_refuses_another_vocabulary_and_notes_other_special_ids(demo_pkg, tmp_path, capfd):
    """coreml_recipe's check of a target's tokenizer against the package, as a draft folder's (loading.py):
    it runs before the Core ML runtime is needed (backend 'mil' here)."""
    from mirror_mlx.ane_draft.coreml_draft import check_package_tokenizer, coreml_recipe

    meta = read_metadata(demo_pkg)
    assert (meta["eos_token_ids"], meta["bos_token_id"]) == ("[2]", "1")  # llama2xs, as mlx_lm.load loads it
    coreml_recipe(demo_pkg, load(str(DEMO_TARGET))[1], backend="mil")
    assert "note:" not in capfd.readouterr().err
    several = load(str(with_config(DEMO_TARGET, tmp_path / "target", eos_token_id=[2, PERIOD])))[1]
    coreml_recipe(demo_pkg, several, backend="mil")
    (note,) = [line for line in capfd.readouterr().err.splitlines() if "note:" in line]
    assert "end-of-sequence ids [2, 426] in the target, [2] in the draft" in note
    # a package that recorded only the whole hash: config.json's ids were never part of it
    whole = {k: v for k, v in meta.items() if k not in ("vocab_sha256", "eos_token_ids", "bos_token_id")}
    check_package_tokenizer(whole, several, demo_pkg)
    other = load(str(swapped_vocab(DEMO_TARGET, tmp_path / "other")))[1]
    for recorded in (meta, whole):
        with pytest.raises(ConvertError, match="built for another tokenizer than the target's"):
            check_package_tokenizer(recorded, other, demo_pkg)
    with pytest.raises(ConvertError, match="built for another tokenizer than the target's"):
        coreml_recipe(demo_pkg, other, backend="mil")


def test_corrupt_or_truncated_package_is_refused(work, demo_pkg):
    bad = work / "truncated.mlpackage"
    shutil.copytree(demo_pkg, bad, dirs_exist_ok=True)
    spec_file = next(bad.rglob("model.mlmodel"))
    spec_file.write_bytes(spec_file.read_bytes()[:1000])
    with pytest.raises(ConvertError, match="corrupt or truncated"):
        read_metadata(bad)
    bad2 = work / "cut-weights.mlpackage"
    shutil.copytree(demo_pkg, bad2, dirs_exist_ok=True)
    blob = next(bad2.rglob("weight.bin"))
    blob.write_bytes(blob.read_bytes()[:5000])
    with pytest.raises(ConvertError, match="corrupt"):
        verify(bad2, DEMO_DRAFT)
    with pytest.raises(ConvertError, match="does not exist"):
        read_metadata(work / "missing.mlpackage")


def test_context_shorter_than_prompt_is_refused(demo_pkg, demo_model):
    draft = PackageDraft(MilRunner(demo_pkg), read_metadata(demo_pkg))
    with pytest.raises(ValueError, match="context has 70 tokens but this Core ML draft was built for 64"):
        draft.rollout(list(range(3, 73)), [[5]], 3)
    long = ("Once upon a time there was a very long story about a cat and a dog. " * 8,)
    with pytest.raises(ConvertError, match="rebuild it with --context"):
        verify(demo_pkg, DEMO_DRAFT, prompts=long, model=demo_model[0], tokenizer=demo_model[1])


# ------------------------------------------------------------------ command line and runtime


def test_cli_convert_and_verify(work):
    from click.testing import CliRunner

    from mirror_mlx.cli import main

    draft, pkg = family_package(work, "qwen2")
    runner = CliRunner()
    ok = runner.invoke(main, ["convert", "--verify", str(pkg), "--draft-model", str(draft)])
    assert ok.exit_code == 0, ok.output
    assert ok.output.startswith("parity OK") and ok.output.count("\n") == 1
    # a package whose numbers are wrong (weights scaled in place) but whose metadata matches: exit 1
    broken = work / "scaled.mlpackage"
    shutil.copytree(pkg, broken, dirs_exist_ok=True)
    assert scale_fp16_blobs(next(broken.rglob("weight.bin")), 1.5) > 5
    bad = runner.invoke(main, ["convert", "--verify", str(broken), "--draft-model", str(draft)])
    assert bad.exit_code == 1 and bad.output.startswith("parity MISMATCH"), bad.output
    gemma = unsupported_folder(work)
    usage = runner.invoke(main, ["convert", "--draft-model", str(gemma)])
    assert usage.exit_code == 2 and "give --out" in usage.output
    wrong = runner.invoke(main, ["convert", "--draft-model", str(gemma), "--out", str(work / "g.mlpackage")])
    assert wrong.exit_code == 2 and "not supported" in wrong.output


def test_coreml_draft_on_linux_fails_at_construction(demo_pkg):
    import sys

    from mirror_mlx.ane_draft.coreml_draft import MESSAGE, CoreMLUnavailable, coreml_available, coreml_recipe

    if sys.platform == "darwin":
        pytest.skip("this checks the non-macOS error; tests/test_coreml_macos.py covers macOS")
    assert not coreml_available()
    with pytest.raises(CoreMLUnavailable) as e:
        coreml_recipe(demo_pkg)
    assert str(e.value) == MESSAGE == "Core ML runs on macOS 15+; use the MLX draft folder here"


def test_package_draft_in_the_draft_host_process(demo_pkg, demo_model):
    from mirror_mlx.ane_draft.coreml_draft import coreml_recipe
    from mirror_mlx.drafts.host import DraftHost

    model, tok = demo_model
    ctx = tok.encode("One day, a little bird")
    stems = [[5], [6, 7], [9, 10, 11]]
    host = DraftHost(coreml_recipe(demo_pkg, tok, backend="mil"))  # the Mac path, with numpy in the host
    assert host.vocab_size == 512
    r = host.rollout(ctx, stems, 3)
    assert r.windows == [greedy_uncached(model, ctx + s, 3) for s in stems]
    with pytest.raises(ValueError, match="built for 64"):
        host.rollout(list(range(3, 80)), [[5]], 2)
    host.reset()
    assert host.rollout(ctx, [[5]], 2).windows == [greedy_uncached(model, ctx + [5], 2)]
    proc = host.proc
    host.close()
    assert proc.poll() is not None


# ------------------------------------------------------------------ Speculative-Streaming drafts


def make_ss_draft(root: Path) -> Path:
    """A tiny random SS draft (mirror_mlx/drafts/ss/model.py): 3 layers, the top 2 carry 2 streams."""
    from mirror_mlx.drafts.ss.model import Model, ModelArgs, save_ss_draft

    mx.random.seed(3)
    args = ModelArgs.from_dict(dict(TINY, model_type="ss_llama", num_hidden_layers=3, tie_word_embeddings=True,
                                    num_streams=2, stream_layers=2))
    model = Model(args)
    model.stream_embeddings = mx.random.normal(model.stream_embeddings.shape)  # make streams matter
    mx.eval(model.parameters())
    save_ss_draft(model, root / "ss", tokenizer_from=DEMO_DRAFT)
    return root / "ss"


def test_ss_draft_package_has_stream_rows_and_passes_parity(work):
    import coremltools as ct

    from mirror_mlx.drafts.ss.model import load_ss_draft

    draft = make_ss_draft(work)
    pkg = convert(draft, work / "ss.mlpackage", progress=False, context=64, kappa=1, gamma=3, chunk=8)
    meta = read_metadata(pkg)
    assert (meta["kind"], meta["streams"], meta["stream_layers"], meta["rows"]) == ("ss", "2", "2", "12")
    funcs = {f.name: f for f in ct.utils.load_spec(str(pkg)).description.functions}
    ins = {i.name: list(i.type.multiArrayType.shape) for i in funcs["rollout"].input}
    K = 64 + 12 * 4
    assert ins["stream_positions"] == [24] and ins["stream_mask"] == [1, K + 12 + 24, 24]
    outs = {o.name: list(o.type.multiArrayType.shape) for o in funcs["rollout"].output}
    assert outs == {"logits": [1, 12, 512], "stream_logits": [1, 24, 512]}
    assert "stream_mask" not in {i.name for i in funcs["extend"].input}  # extend: main rows only
    assert op_types(load_program(pkg)) <= ANE_OPS
    report = verify(pkg, draft, steps=2, prompts=PROMPTS[:1])  # main and stream logits of every row vs ss_forward
    assert report.ok, report.line()
    model, tok = load_ss_draft(draft)
    ctx = tok.encode("Once upon a time")
    stems = [[5], [6, 7], [9]]
    r = PackageDraft(MilRunner(pkg), meta).rollout(ctx, stems, 3)
    assert r.windows == [greedy_uncached(model, ctx + s, 3) for s in stems]  # streams never change the text


class Counting:
    """A fake package: the next token is always t+1, and stream j guesses t+1+j (right or not)."""

    def __init__(self, meta: dict, right: bool):
        self.B, self.NS, self.V, self.right = int(meta["rows"]), int(meta["streams"]), int(meta["vocab"]), right
        self.calls = 0

    def reset(self):
        pass

    def call(self, fn, inputs):
        ids = inputs["input_ids"][0]
        onehot = lambda t: np.eye(self.V, dtype=np.float32)[t % self.V]  # noqa: E731
        out = {"logits": onehot(ids + 1)[None]}
        self.calls += 1
        if fn == "rollout" and self.NS:
            guess = [ids + 1 + j + 1 if self.right else ids for j in range(self.NS)]
            out["stream_logits"] = np.concatenate([onehot(g) for g in guess])[None]
        return out


@pytest.mark.parametrize("right,calls", [(True, 2 + 1 + 2), (False, 2 + 1 + 6)])
def test_ss_host_keeps_agreeing_guesses(right, calls):
    shapes = coreml.Shapes.make(64, kappa=2, gamma=7, chunk=8, streams=2)
    meta = {k: str(v) for k, v in shapes.__dict__.items()} | {"vocab": "100", "logit_outputs": "1"}
    runner = Counting(meta, right)
    ctx = list(range(10, 20))
    stems = [[20], [20, 21], [50]]
    r = PackageDraft(runner, meta).rollout(ctx, stems, 7)
    assert r.windows == [[s[-1] + 1 + i for i in range(7)] for s in stems]
    # 2 extend calls (10 context tokens, chunk 8), then 1 + ceil(6 / 3) when every guess is right, else 1 + 6
    assert r.forwards == runner.calls == calls


# ------------------------------------------------------------------ distilled drafts (a trimmed head)


def make_distilled_draft(root: Path, drop: int = 0) -> Path:
    """A tiny distilled draft (drafts/distilled/model.py) of the demo target: its first layer frozen, one more,
    and a head over the ids of the parity prompts, EOS and every other id of 3..39 (`drop`: less its
    `drop` highest kept ids)."""
    from mirror_mlx.drafts.distilled.model import new_draft, save_draft

    target, tok = load(str(DEMO_TARGET))
    config = json.loads((DEMO_TARGET / "config.json").read_text())
    kept = sorted({2, *range(3, 40, 2)}.union(*(tok.encode(p) for p in PROMPTS)))
    draft = new_draft(target, config, 1, 1, kept[: len(kept) - drop])
    return save_draft(draft, root / f"distilled-{drop}", tokenizer_from=DEMO_TARGET)


@pytest.fixture(scope="module")
def distilled(work):
    draft = make_distilled_draft(work)
    return draft, convert(draft, work / "distilled.mlpackage", progress=False, **SMALL)


def test_distilled_package_outputs_its_kept_columns_and_records_their_ids(distilled):
    import coremltools as ct

    from mirror_mlx.ane_draft.package_format import read_kept_ids
    from mirror_mlx.loading import load_model

    draft, pkg = distilled
    model = load_model(draft)[0]
    kept = np.array(model.kept_ids)
    V = kept.size
    assert 40 < V < 512
    for f in ct.utils.load_spec(str(pkg)).description.functions:
        (out,) = f.output
        assert list(out.type.multiArrayType.shape)[2] == V  # V logits per row, not the vocabulary's 512
    meta = read_metadata(pkg)
    assert meta["model_type"] == "mirror_distilled" and meta["vocab"] == "512"
    assert read_kept_ids(meta).tolist() == kept.tolist()
    assert op_types(load_program(pkg)) <= ANE_OPS


def test_distilled_cli_verify_passes_and_scaled_weights_fail(work, distilled):
    from click.testing import CliRunner

    from mirror_mlx.cli import main

    draft, pkg = distilled
    runner = CliRunner()
    ok = runner.invoke(main, ["convert", "--verify", str(pkg), "--draft-model", str(draft)])
    assert ok.exit_code == 0 and ok.output.startswith("parity OK"), ok.output
    broken = work / "distilled-scaled.mlpackage"
    shutil.copytree(pkg, broken, dirs_exist_ok=True)
    assert scale_fp16_blobs(next(broken.rglob("weight.bin")), 1.5) > 5
    bad = runner.invoke(main, ["convert", "--verify", str(broken), "--draft-model", str(draft)])
    assert bad.exit_code == 1 and bad.output.startswith("parity MISMATCH"), bad.output


def test_distilled_rollout_gives_kept_ids_equal_to_the_mlx_draft(distilled):
    from mirror_mlx.drafts.recipes import mlx_draft

    draft, pkg = distilled
    mlx = mlx_draft(draft)  # the MLX distilled draft as the engine runs it: full-vocabulary logits
    kept = set(np.array(mlx.model.kept_ids).tolist())
    ctx = load(str(DEMO_TARGET))[1].encode("Once upon a time, there was a little girl")
    host = PackageDraft(MilRunner(pkg), read_metadata(pkg))
    for stems in ([[5], [4], [300]], [[300, 11], [300, 12]]):  # ids off the kept ones too (the target's tokens)
        got = host.rollout(ctx, stems, 3)
        assert all(t in kept for w in got.windows for t in w)
        assert got.windows == mlx.rollout(ctx, stems, 3).windows


def test_distilled_package_with_other_kept_ids_is_refused(work, distilled, tiny_llama):
    from mirror_mlx.ane_draft.package_format import kept_ids_metadata, read_kept_ids

    draft, pkg = distilled
    fewer = make_distilled_draft(work, drop=3)
    with pytest.raises(ConvertError, match=r"with other kept ids \(\d+ ids\) than this draft's .*mirror-mlx convert"):
        verify(pkg, fewer)
    with pytest.raises(ConvertError, match="other kept ids .* than this draft's \\(the whole vocabulary\\)"):
        verify(pkg, tiny_llama)
    # a package whose recorded ids do not match its own head's width: refused at its first call
    meta = read_metadata(pkg)
    meta["kept_ids"] = kept_ids_metadata(read_kept_ids(meta)[:-1], 512)
    with pytest.raises(ValueError, match="logits per row but records .* kept ids: it is corrupt"):
        PackageDraft(MilRunner(pkg), meta).rollout([1, 2, 3], [[4]], 2)


def test_gamma_beyond_the_package_is_refused(demo_pkg):
    draft = PackageDraft(MilRunner(demo_pkg), read_metadata(demo_pkg))
    with pytest.raises(ValueError, match="built for; rebuild it with `mirror-mlx convert --gamma 5`"):
        draft.rollout([1, 2, 3], [[4]], 5)


def test_quantized_mlx_draft_is_read_dequantized(work):
    import mlx.nn as nn

    from mirror_mlx.convert.coreml import spec_from_model

    model, _ = load(str(family_package(work, "qwen2")[0]))
    nn.quantize(model, group_size=32, bits=4)
    spec = spec_from_model(model, {}, "-", 64)
    layer = model.model.layers[0].self_attn.q_proj
    x = mx.random.normal((3, 64))
    want = np.array(layer(x))
    got = np.array(x) @ spec.weights["0.q_proj"].T + spec.weights["0.q_proj.bias"]
    assert np.abs(got - want).max() < 1e-4
    emb = np.array(model.model.embed_tokens(mx.array([7])))[0]
    assert np.abs(spec.weights["embed"][7] - emb).max() < 1e-6


# ------------------------------------------------------------------ real widths, tokenizers, k-means, quantized drafts


def test_real_width_qwen3_two_layers_one_table_sampled_parity(work):
    """Qwen3-0.6B's widths and vocabulary (hidden 1024, 16/8 heads of 128, intermediate 3072,
    151,936 tied rows in 10 head pieces, qk-norm) at 2 layers: converted, one table, verified on a
    sample of rows."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from qwen3_shape import qwen3_draft

    from mirror_mlx.convert.parity import Budget

    draft = qwen3_draft(work / "qwen3-real", layers=2)
    pkg = convert(draft, work / "qwen3-real.mlpackage", progress=False, context=64, kappa=2, gamma=2, chunk=16)
    meta = read_metadata(pkg)
    assert (meta["vocab"], meta["logit_outputs"], meta["layers"]) == ("151936", "10", "2")
    model, tok = load(str(draft))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))  # tied: the table counted once
    blob = (pkg / "Data" / "com.apple.CoreML" / "weights" / "weight.bin").stat().st_size
    assert 2 * n_params <= blob < 2 * n_params * 1.01  # fp16, one table (a second one would be +2*151936*1024)
    report = verify(pkg, draft, steps=1, prompts=PROMPTS[:1], model=model, tokenizer=tok, budget=Budget(rows=6))
    assert report.ok, report.line()
    assert report.rollout_rows <= 6 < report.produced_rows and "sampled" in report.line()
    assert report.scale > 1.0 and report.greedy > 10


def test_mismatched_tokenizer_is_refused(work):
    big_vocab = make_draft(work, "llama", vocab_size=4096)  # the demo's 512-token tokenizer beside 4,096 rows
    with pytest.raises(ConvertError, match="has 512 tokens .* vocabulary has 4,096: it is not this model's tokenizer"):
        convert(big_vocab, work / "x.mlpackage", progress=False, **SMALL)
    small_vocab = make_draft(work, "llama", vocab_size=500)  # ids 500..511 would have no logits
    with pytest.raises(ConvertError, match="the tokenizer has 512 token ids but the model's vocabulary is 500"):
        convert(small_vocab, work / "x.mlpackage", progress=False, **SMALL)


def test_kmeans_lut_is_lloyd_optimal_and_memoised():
    rng = np.random.default_rng(0)
    val = (rng.standard_normal((16, 300, 1, 1)) * 0.05).astype(np.float16)
    fn = coreml._kmeans_lut(4)
    lut, idx = fn(val)
    assert lut.shape == (16,) and lut.dtype == np.float16 and idx.shape == (16 * 300,) and idx.max() < 16
    x = val.astype(np.float32).ravel()
    err = ((lut.astype(np.float32)[idx] - x) ** 2).mean()
    nearest = np.abs(x[:, None] - lut.astype(np.float32)[None]).argmin(1)
    assert (np.abs(lut.astype(np.float32)[idx] - x) <= np.abs(lut.astype(np.float32)[nearest] - x) + 1e-7).all()
    uniform = np.linspace(x.min(), x.max(), 16)  # a uniform 4-bit grid does worse than k-means
    assert err < 0.8 * ((uniform[np.abs(x[:, None] - uniform[None]).argmin(1)] - x) ** 2).mean()
    assert fn(val.copy())[0] is lut  # equal groups (both functions' copies) get the same LUT object


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_mlx_draft_converts_at_fp16_tolerance(work, bits):
    """A 4/8-bit MLX draft (mlx-lm's own quantize_model on the demo llama2xs) is packaged as its
    dequantized weights in fp16, so it is held to the fp16 tolerance against itself run in float32."""
    from mlx_lm.utils import quantize_model

    model, tok = load(str(DEMO_DRAFT))
    config = json.loads((DEMO_DRAFT / "config.json").read_text())
    model, config = quantize_model(model, config, group_size=32, bits=bits)
    draft = work / f"llama2xs-{bits}bit"
    save_model(draft, model)
    save_config(config, draft / "config.json")
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(DEMO_DRAFT / f, draft / f)
    pkg = convert(draft, work / f"llama2xs-{bits}bit.mlpackage", progress=False, **SMALL)
    report = verify(pkg, draft, steps=2, prompts=PROMPTS[:1])
    assert report.quantize == "none" and report.ok, report.line()
    assert report.max_abs < 0.03 * report.scale + 0.05


# ------------------------------------------------------------------ the evaluator and the reference at real size


def test_round_fp16_is_numpys_cast_bit_for_bit():
    from mirror_mlx.convert.mil_eval import round_fp16

    rng = np.random.default_rng(0)
    wide = (rng.standard_normal(200_000) * np.exp(rng.uniform(-30, 14, 200_000))).astype(np.float32)
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)  # NaNs and infs too
    fin = np.sort(every[np.isfinite(every)])
    ties = ((fin[1:].astype(np.float64) + fin[:-1]) / 2).astype(np.float32)  # halfway: to the even one
    edges = np.array([0.0, -0.0, 65519.99, 65520, -65520, 3e38, 2**-14, 2**-24, 2**-25, 2**-26], np.float32)
    x = np.concatenate([wide, every, ties, np.nextafter(ties, np.float32(np.inf)),
                        np.nextafter(ties, np.float32(-np.inf)), edges])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(round_fp16(x.copy()).view(np.uint32), want.view(np.uint32))


def test_runner_holds_each_weight_once_in_float32(demo_pkg):
    runner = MilRunner(demo_pkg)
    weights = {fn: [op.weight.val for op in f.operations if op.op_type == "conv"]
               for fn, f in runner.program.functions.items()}
    assert all(w.dtype == np.float32 for ws in weights.values() for w in ws) and len(weights["extend"]) > 5
    assert [id(w) for w in weights["extend"]] == [id(w) for w in weights["rollout"]]  # one array, both functions


def test_reference_rows_on_the_window_prefix_equal_full_forwards(demo_model):
    from mirror_mlx.convert.parity import Reference, float32_reference

    model = float32_reference(demo_model[0])
    ctx = demo_model[1].encode(PROMPTS[0])
    ref = Reference(model, ctx)
    window, stems = ref.stems(2, 3)
    paths = {tuple(s[:m]) for s in stems for m in range(1, len(s) + 1)} | {tuple(window[:2]) + (7, 8)}
    got = ref.rows(sorted(paths))
    for p in paths:
        want = np.array(model(mx.array([ctx + list(p)]))[0, -1].astype(mx.float32))
        assert np.abs(got[p] - want).max() < 1e-4, p


def test_verify_budget_parses_and_real_size_drafts_check_one_step_per_prompt(demo_pkg, demo_model, monkeypatch):
    from mirror_mlx.convert import parity
    from mirror_mlx.convert.parity import Budget

    assert Budget.parse("5m").seconds == 300 and Budget.parse("2000rows").rows == 2000
    assert Budget.parse("1steps").steps == 1 and Budget.parse("all") == Budget()
    with pytest.raises(ConvertError, match="--verify-budget must be"):
        Budget.parse("1.5steps")
    assert Budget.default(parity.REAL_SIZE - 1) == Budget() and Budget.default(596_049_920).steps == 1
    monkeypatch.setattr(parity, "REAL_SIZE", 1000)  # the demo draft counts as real size
    report = verify(demo_pkg, DEMO_DRAFT, model=demo_model[0], tokenizer=demo_model[1])
    assert report.ok and (report.steps, report.planned_steps) == (2, 6)
    assert "2 of 6 steps (0.279M parameters: the first of each prompt by default" in report.line()
