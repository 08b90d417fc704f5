"""Mirror-SD with the Speculative-Streaming demo draft returns exactly mlx-lm's greedy tokens."""

import pytest
from mlx_lm import load

from mirror_mlx.demo import SS_DRAFT as SS_DEMO
from mirror_mlx.pipeline import Pipeline, load_draft
from tests.models import TARGET_PATH
from tests.support import assert_lossless, openings, reference_greedy



@pytest.fixture(scope="module")
def ss_pipe():
    target, tokenizer = load(str(TARGET_PATH))
    pipe = Pipeline(target, tokenizer, load_draft(SS_DEMO, tokenizer))
    assert pipe.engine.host.kind == "SSDraft"  # the folder is recognised as an SS draft (built in the host)
    yield pipe
    pipe.close()


@pytest.mark.parametrize("branches", [None, 5])  # B: a branch budget, of κ(γ+1) = 12
def test_mirror_with_the_ss_draft_equals_mlx_lm_greedy_on_20_openings(ss_pipe, branches):
    forwards = windows = 0
    for text in openings(20 if branches is None else 5):
        prompt = ss_pipe.tokenizer.encode(text)
        out = ss_pipe.generate(prompt, max_tokens=48, kappa=2, gamma=5, branches=branches, stop=False)
        assert_lossless(out.tokens, reference_greedy(ss_pipe.model, prompt, 48), f"diverged on {text!r}")
        forwards += out.stats.draft_forwards
        windows += out.stats.rollouts
    assert forwards / windows <= 3  # J ≤ ⌈γ/2⌉ draft forwards per window, every forward counted


def test_sd_with_the_ss_draft_equals_mlx_lm_greedy(ss_pipe):
    for text in openings(5):
        prompt = ss_pipe.tokenizer.encode(text)
        assert_lossless(ss_pipe.generate(prompt, max_tokens=48, mode="sd", gamma=5, stop=False).tokens,
                        reference_greedy(ss_pipe.model, prompt, 48))
