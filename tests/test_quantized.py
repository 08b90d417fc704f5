"""4-bit and 8-bit targets and drafts, quantized by mlx-lm's own converter: lossless in every mode, and
the early exit is exact on them.

The demo pair is widened first (`mirror-mlx widen`: the same function at widths that group sizes 32
and 64 divide), then `mlx_lm.convert(quantize=True)` writes the quantized folders a user would get.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from click.testing import CliRunner
from mlx_lm import convert, load
from mlx_lm import stream_generate as mlx_stream_generate

import mirror_mlx
from mirror_mlx.cli import main
from mirror_mlx.pipeline import load as load_pipeline
from tests.models import DRAFT_PATH, TARGET_PATH
from tests.support import assert_lossless, check_two_logits

WIDE = ["--hidden", "128", "--heads", "16", "--kv-heads", "8", "--intermediate", "256"]
PROMPT = "Once upon a time, there was a little dog"
QUANT = [(4, 64), (8, 32)]  # (bits, group size)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{(bits, group): (target folder, draft folder)}"""
    root = tmp_path_factory.mktemp("quantized")
    wide = {}
    for name, path, layers in (("target", TARGET_PATH, "6"), ("draft", DRAFT_PATH, "5")):
        wide[name] = root / f"{name}-wide"
        r = CliRunner().invoke(main, ["widen", "--model", str(path), "--out", str(wide[name]), *WIDE, "--layers", layers])
        assert r.exit_code == 0, r.output
    out = {}
    for bits, group in QUANT:
        for name in ("target", "draft"):
            convert(str(wide[name]), str(root / f"{name}-q{bits}"), quantize=True, q_bits=bits, q_group_size=group)
        out[bits, group] = (root / f"target-q{bits}", root / f"draft-q{bits}")
    return out


@pytest.mark.parametrize("bits, group", QUANT)
def test_the_folders_hold_quantized_weights(folders, bits, group):
    for folder in folders[bits, group]:
        model, _ = load(str(folder))
        q = model.layers[0].self_attn.q_proj
        assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (bits, group)


@pytest.mark.parametrize("bits, group", QUANT)
def test_every_mode_returns_mlx_lm_s_greedy_tokens(folders, bits, group):
    target, draft = folders[bits, group]
    model, tokenizer = load(str(target))
    expected = [r.token for r in mlx_stream_generate(model, tokenizer, PROMPT, max_tokens=24)]
    pipe = load_pipeline(target, draft)
    try:
        for mode in ("ar", "sd", "mirror"):
            out = pipe.generate(PROMPT, max_tokens=24, mode=mode, kappa=4, gamma=4, stop=False)
            assert_lossless(out.tokens, expected[: len(out.tokens)], mode)
            assert len(out.tokens) == len(expected), mode
        assert pipe.stats.mean_accepted > 1.5  # the quantized draft still proposes what the target takes
    finally:
        pipe.close()
    draft_model, _ = load(str(draft))  # and through the mlx-lm-shaped API, with mlx-lm model objects
    ours = [r.token for r in mirror_mlx.stream_generate(model, tokenizer, PROMPT, max_tokens=24, draft_model=draft_model)]
    assert ours == expected


@pytest.mark.parametrize("bits, group", QUANT)
def test_the_early_exit_is_exact_on_a_quantized_target(folders, bits, group):
    model, tokenizer = load(str(folders[bits, group][0]))
    tokens = mx.array([tokenizer.encode(PROMPT)])
    for exit_layer in (1, 3, 5):
        check_two_logits(model, tokens, exit_layer)
