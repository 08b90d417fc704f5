"""Temperature > 0 over whole generations: every committed token, at every row of every step, is a
sample of the target's processed distribution given the tokens before it.

An 8-token vocabulary makes the target's processed distribution q(· | prefix) exact at every position
of every generation: one forward of the target over the prompt and the generated tokens gives all of
them, processed by mlx-lm's own logits processors and sampling filters. Each committed token is one
draw from its q, also within any group of tokens picked by what came before the draw: its row in its
step (0: the target's own token at the pending row, 1..γ-1: after accepted draft tokens, γ: the
bonus token), or the token before it. `conditional_test` compares the counts with their expectation
Σ q through the exact covariance Σ (diag q - q qᵀ) (a martingale chi-square, pooled over contexts;
with one context it is Pearson's). The draft is the target itself, in its own host process, so that
windows are often accepted whole (bonus tokens), and κ = 2 of 8 tokens makes mirror both reuse a
branch and fall back; every test asserts that each of these happened.
"""

import mlx.core as mx
import pytest

from mirror_mlx.drafts.recipes import DraftRecipe, mlx_draft
from mirror_mlx.drafts.mlx_draft import MLXDraft
from mirror_mlx.pipeline import Pipeline
from tests.models import save_tiny_model, tiny_model
from tests.support import FakeTokenizer
from tests.support.whole_sampling import RUNS, SEEDED_P, SEEDS, SETTINGS, SHAPE, V, check_steps, sample

RECURRENT_FAMILY = "mamba2"  # its tied head makes windows often accepted whole (bonus rows)
UNSEEDED_P = 1e-6  # see test_unseeded_tokens_follow_the_target_distribution


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The target, and a pipeline whose draft is the same model, loaded by its own host process."""
    target = tiny_model("llama_tied", seed=11, **SHAPE)
    draft = save_tiny_model(tmp_path_factory.mktemp("draft"), "llama_tied", seed=11, **SHAPE)
    pipe = Pipeline(target, FakeTokenizer(V), DraftRecipe(mlx_draft, (str(draft),)))
    assert pipe.engine.host.process
    yield target, pipe
    pipe.close()


@pytest.mark.parametrize("mode,name,branches", [("mirror", name, None) for name in SETTINGS]
                         + [("mirror", "all", 2), ("sd", "all", None)])
def test_every_committed_token_follows_the_target_distribution(pair, mode, name, branches):
    """B: a branch budget (of κ(γ+1) = 8 here), which only changes which windows were precomputed."""
    target, pipe = pair
    p, seen = sample(target, pipe, mode, SETTINGS[name], SEEDS[mode], branches=branches)
    check_steps(mode, seen)
    assert min(p.values()) > SEEDED_P, f"{mode} {name}: committed tokens do not follow the target ({p}, {seen})"


def test_tokens_with_the_lookup_follow_the_target_distribution(pair):
    """sd with the prompt lookup beside the draft: its windows (copied from the context) were accepted and
    rejected, and every committed token still follows the target."""
    target, pipe = pair
    p, seen = sample(target, pipe, "sd", SETTINGS["all"], range(2000, 2000 + RUNS), lookup=True)
    check_steps("sd", seen)
    assert seen["lookup_accepted"] >= 20 and seen["lookup_rejections"] >= 20, seen
    assert min(p.values()) > SEEDED_P, f"sd with lookup: committed tokens do not follow the target ({p}, {seen})"


@pytest.mark.parametrize("mode", ["mirror", "sd"])
def test_unseeded_tokens_follow_the_target_distribution(pair, mode):
    """seed=None (the server's default): every row of a step is drawn at once from MLX's global
    generator, through the filters on all rows together.

    Not deterministic, so the threshold is a false-failure rate: four p-values, each uniform under the
    null, one below 1e-6 with probability at most 4e-6 a run (1e-6 leaves room for the chi-square
    approximation's tails; the broken samplers below give p-values below 1e-8)."""
    target, pipe = pair
    p, seen = sample(target, pipe, mode, SETTINGS["all"], [None] * RUNS)
    check_steps(mode, seen)
    assert min(p.values()) > UNSEEDED_P, f"{mode} unseeded: committed tokens do not follow the target ({p})"


def _skewed(logprobs: mx.array) -> mx.array:
    """A sampler drawn to the most likely token: its argmax half the time, else a fair draw."""
    fair = mx.random.categorical(logprobs)
    return mx.where(mx.random.uniform(shape=fair.shape) < 0.5, mx.argmax(logprobs, axis=-1), fair)


def _one_noise(logprobs: mx.array) -> mx.array:
    """A sampler that draws one noise vector and uses it for every row it is given at once."""
    return mx.argmax(logprobs + mx.random.gumbel(shape=(1, logprobs.shape[-1])), axis=-1)


WRONG = {  # a wrong sampler, its seeds, what the check expects
    "temperature 1.3": (dict(temperature=1.3), SEEDS["mirror"]),
    "skewed to the most likely token": (dict(sampler=_skewed), SEEDS["mirror"]),
    "one noise for all rows": (dict(sampler=_one_noise), [None] * RUNS),
}


@pytest.mark.parametrize("wrong", WRONG)
def test_the_check_rejects_a_wrong_sampler(pair, wrong):
    """The same check, on as many of the pipeline's own generations, rejects a sampler that is not the
    target's at temperature 1 (so the tests above can fail)."""
    target, pipe = pair
    settings, seeds = WRONG[wrong]
    p, _ = sample(target, pipe, "mirror", settings, seeds, expect=dict(temperature=1.0))
    assert min(p.values()) < SEEDED_P * 1e-2, f"{wrong}: not rejected ({p})"


def test_a_recurrent_target_and_draft_follow_the_target_distribution():
    """The same check on a target with recurrent state (RECURRENT_FAMILY's SSM layers), its own copy as
    draft: every rejected window's rows are dropped from both recurrent states exactly."""
    target = tiny_model(RECURRENT_FAMILY, seed=11, vocab_size=V)
    pipe = Pipeline(target, FakeTokenizer(V), MLXDraft(tiny_model(RECURRENT_FAMILY, seed=11, vocab_size=V)))
    try:
        p, seen = sample(target, pipe, "mirror", SETTINGS["temperature"], SEEDS["mirror"])
    finally:
        pipe.close()
    check_steps("mirror", seen)
    assert min(p.values()) > SEEDED_P, f"{RECURRENT_FAMILY}: committed tokens do not follow the target ({p}, {seen})"
