"""The early-exit adapter: it sharpens the early exit, round-trips, refuses the wrong model, and
never touches the target's own logits. Plus Ω_κ on a case computed by hand."""

import math
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm import generate as mlx_generate

from mirror_mlx.cli import main
from mirror_mlx.corpus import CORPUS
from mirror_mlx.engine.exit_adapter import ExitAdapter, adapter_meta, fingerprint, load_adapter, save_adapter
from mirror_mlx.engine.target import apply_head
from mirror_mlx.train.exit_adapter import ExitData, fit_adapter, kl, train_exit_adapter
from mirror_mlx.tune.omega import format_table, measure, omega_sums
from mirror_mlx.engine.model_parts import text_model, trimmable_cache
from mirror_mlx.engine.target import EarlyExitTarget
from tests.models import DEMO, CONFIGS, demo_target, tiny_model

SHIPPED = DEMO / "stories260K_exit2.safetensors"


@pytest.fixture(scope="module")
def demo():
    return demo_target()


@pytest.fixture(scope="module")
def trained(demo):
    model, tokenizer = demo
    adapter, report = train_exit_adapter(model, tokenizer, 2, CORPUS.read_text(), rank=64, steps=150,
                                         max_openings=40, held_out_openings=12, max_tokens=32, progress=False)
    return adapter, report


def test_training_lowers_kl_on_held_out_text(trained):
    _, r = trained
    assert r.held_out_rows > 200 and r.train_rows > 500
    assert r.kl_after < 0.6 * r.kl_before, (r.kl_before, r.kl_after)


def test_training_is_deterministic_with_a_seed(demo):
    model, _ = demo
    mx.random.seed(123)
    data = ExitData(mx.random.normal((300, 64)), mx.random.normal((300, 64)))
    a = fit_adapter(model, data, 8, 20, seed=5, batch_size=64, progress=False)
    b = fit_adapter(model, data, 8, 20, seed=5, batch_size=64, progress=False)
    c = fit_adapter(model, data, 8, 20, seed=6, batch_size=64, progress=False)
    assert mx.array_equal(a.up.weight, b.up.weight) and mx.array_equal(a.down.weight, b.down.weight)
    assert not mx.array_equal(a.up.weight, c.up.weight)


def test_fresh_adapter_is_the_identity_so_the_bare_head():
    x = mx.random.normal((2, 3, 64))
    assert mx.array_equal(ExitAdapter(64, 16)(x), x)


@pytest.mark.parametrize("name", ["llama_untied", "qwen3", "gemma3_text"])
def test_apply_head_is_the_models_own_head(name):
    model = tiny_model(name)
    tokens = mx.array([[1, 5, 9, 3, 7]])
    assert mx.allclose(apply_head(model, text_model(model).model(tokens)), model(tokens), atol=1e-6)


def test_save_load_round_trip_gives_identical_early_logits(demo, trained, tmp_path):
    model, tokenizer = demo
    adapter, _ = trained
    path = tmp_path / "a.safetensors"
    save_adapter(path, adapter, adapter_meta(model, 2, note="test"))
    loaded = load_adapter(path, model, 2)
    assert loaded.exit_layer == 2
    tokens = mx.array([tokenizer.encode("Once upon a time, there was a little cat")])
    outs = []
    for a in (adapter, loaded, None):
        target = EarlyExitTarget(model, 2, a)
        outs.append(target.forward(tokens, trimmable_cache(target.model)))
        mx.eval(outs[-1])
        target.remove()
    assert mx.array_equal(outs[0][0], outs[1][0])
    assert not mx.allclose(outs[0][0], outs[2][0], atol=1e-3)  # the adapter does change the early exit


def test_adapter_for_another_model_or_layer_is_refused(demo, trained, tmp_path):
    model, _ = demo
    adapter, _ = trained
    path = tmp_path / "a.safetensors"
    save_adapter(path, adapter, adapter_meta(model, 2))
    with pytest.raises(ValueError, match="trained for exit layer 2, not 3"):
        load_adapter(path, model, 3)
    other = tiny_model("llama_tied")  # same width, another model
    with pytest.raises(ValueError, match="another model"):
        load_adapter(path, other, 2)
    draft, _ = __import__("mlx_lm").load(str(DEMO / "llama2xs"))  # same shape family and vocab, other weights
    assert fingerprint(draft) != fingerprint(model)
    with pytest.raises(ValueError, match="another model"):
        load_adapter(path, draft)
    bogus = tmp_path / "b.safetensors"
    mx.save_safetensors(str(bogus), {"w": mx.zeros(3)})
    with pytest.raises(ValueError, match="not a mirror-mlx exit adapter"):
        load_adapter(bogus, model, 2)


def test_final_logits_and_greedy_tokens_are_untouched_by_the_adapter(demo):
    """The adapter only feeds the early head: the target's own logits are bit-identical, so tokens are too."""
    model, tokenizer = demo
    adapter = load_adapter(SHIPPED, model, 2)
    prompt = tokenizer.encode("Tom and Lily went to the park.")
    streams = []
    for a in (None, adapter):
        target = EarlyExitTarget(model, 2, a)
        cache, y, toks, finals = trimmable_cache(target.model), prompt, [], []
        for _ in range(24):
            early, final = target.forward(mx.array([y]), cache)
            mx.eval(early, final)  # early first, as the engine does
            finals.append(final[0, -1])
            y = [mx.argmax(final[0, -1]).item()]
            toks += y
        target.remove()
        streams.append((toks, mx.stack(finals)))
    assert streams[0][0] == streams[1][0]
    assert mx.array_equal(streams[0][1], streams[1][1])
    ref = mlx_generate(model, tokenizer, prompt, max_tokens=24)
    assert tokenizer.decode(streams[1][0]) == ref


def test_omega_by_hand():
    p = [[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]]
    final = mx.log(mx.array(p))
    early = mx.array([[0.3, 0.4, 0.1, 0.2], [0.1, 0.2, 0.3, 0.4], [4.0, 3.0, 2.0, 1.0]])  # orders 1032, 3210, 0123
    draft = [1, 0, 0]  # rows 0, 1: the draft misses the target's argmax (0, 3); row 2: it hits (0)
    s = omega_sums(early, final, draft, kappas=(1, 2))
    rejected = 0.7 + 0.9 + 0.3
    assert s.rows == 3 and s.misses == 2 and s.rejected == pytest.approx(rejected, abs=1e-6)
    assert s.omega("plain") == pytest.approx([1.4 / 3, 2.3 / 3], abs=1e-6)
    # bare set at a rejection: the draft token's own mass does not count (row 0 κ=1 set is {ŷ})
    assert s.omega("bare") == pytest.approx([0.4 / rejected, 1.3 / rejected], abs=1e-6)
    # rule: row 0 → {0}, {0,3}; row 1 → {3}, {3,2}; row 2 → {1}, {1,2}
    assert s.omega("rule") == pytest.approx([1.0 / rejected, 1.45 / rejected], abs=1e-6)
    assert s.omega("hit_bare") == [0.5, 1.0]
    assert s.omega("hit_rule") == [1.0, 1.0]


def test_shipped_adapter_sharpens_the_demo_exit(demo):
    model, tokenizer = demo
    draft, _ = __import__("mlx_lm").load(str(DEMO / "llama2xs"))
    adapter = load_adapter(SHIPPED, model, 2)
    texts = ["Tom and Lily went to the park.", "One day, a little bird flew into the garden."]
    bare, adapted = measure(model, tokenizer, draft, texts, layers=[2], adapters={2: ("exit2", adapter)},
                            max_tokens=32)
    assert bare.adapter == "-" and adapted.adapter == "exit2"
    assert adapted.sums.omega("rule")[3] > bare.sums.omega("rule")[3] + 0.1
    assert "| 2 | exit2 | at rejection, rule |" in format_table([bare, adapted])


def test_cli_refuses_bad_input_with_one_sentence(tmp_path):
    r = CliRunner().invoke(main, ["train-exit", "--exit-layer", "7", "--out", str(tmp_path / "a.safetensors")])
    assert r.exit_code == 2 and "outside 1..4" in r.output
    r = CliRunner().invoke(main, ["train-exit", "--out", str(tmp_path / "a.bin")])
    assert r.exit_code == 2 and ".safetensors" in r.output
    r = CliRunner().invoke(main, ["omega", "--model", str(DEMO / "stories260K")])
    assert r.exit_code == 2 and "--draft-model" in r.output


def test_cli_omega_with_the_shipped_adapter():
    r = CliRunner().invoke(main, ["omega", "--exit-adapter", str(SHIPPED), "--prompts", "2", "--max-tokens", "8",
                                  "--exit-layer", "2"])
    assert r.exit_code == 0, r.output
    assert "| 2 | stories260K_exit2 | all rows, top-κ |" in r.output
    assert not math.isnan(float(r.output.split("| 2 | - | all rows, top-κ | ")[1].split(" |")[0]))


def test_pipeline_with_the_adapter_generates_mlx_lm_greedy_text():
    from mirror_mlx.pipeline import load

    prompt = "Once upon a time, there was a little dog."
    outs = []
    for adapter in (None, SHIPPED):  # mirror at the adapter's layer, both times (auto could choose another mode)
        pipe = load(exit_adapter=adapter)
        try:
            outs.append(pipe.generate(prompt, max_tokens=32, mode="mirror", kappa=2, gamma=3, exit_layer=2, branches=8))
        finally:
            pipe.close()
    model, tokenizer = demo_target()
    assert outs[0].tokens == outs[1].tokens
    assert outs[1].text == mlx_generate(model, tokenizer, prompt, max_tokens=32)
    assert outs[1].stats.reuses >= outs[0].stats.reuses  # the sharper exit prepares the right branch more often
