"""mlx-lm's own loops as baselines: greedy tokens match a hand-written loop, and each other."""

import pytest
from mlx_lm import load

from mirror_mlx.bench.baselines import best_mlx_sd, run_ar, run_mlx_sd
from models import DRAFT_PATH, TARGET_PATH
from tests.support import assert_lossless, greedy_uncached

PROMPTS = ["Once upon a time, there was a little girl named Lily.", "Tom and his dog went to the park"]
N = 16


@pytest.fixture(scope="module")
def pair():
    model, tok = load(str(TARGET_PATH))
    draft, _ = load(str(DRAFT_PATH))
    return model, draft, [tok.encode(p) for p in PROMPTS]


def test_ar_greedy_is_greedy(pair):
    model, _, prompts = pair
    for p in prompts:
        r = run_ar(model, p, N)
        assert_lossless(r.tokens, greedy_uncached(model, p, N))
        assert r.mode == "ar" and r.target_forwards == N + 1  # mlx-lm computes one token ahead
        assert r.decode_s > 0 and r.tokens_per_s == pytest.approx(N / r.decode_s)
        assert r.prefill_s > 0 and r.peak_memory > 0 and r.accepted_per_forward is None


def test_mlx_sd_greedy_equals_ar(pair):
    model, draft, prompts = pair
    for p in prompts:
        ar = run_ar(model, p, N)
        for k in (2, 4):
            sd = run_mlx_sd(model, draft, p, N, k)
            assert_lossless(sd.tokens, ar.tokens)
            assert 1 <= sd.target_forwards < N  # the draft is right sometimes
            assert sd.accepted_per_forward == pytest.approx(N / sd.target_forwards)
            assert 1 < sd.accepted_per_forward <= k + 1 and sd.num_draft_tokens == k


def test_sampled_runs_follow_the_seed(pair):
    model, _, prompts = pair
    a, b = run_ar(model, prompts[0], N, temp=1.0, seed=3), run_ar(model, prompts[0], N, temp=1.0, seed=3)
    c = run_ar(model, prompts[0], N, temp=1.0, seed=4)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_stop_tokens_end_the_run(pair):
    model, _, prompts = pair
    full = run_ar(model, prompts[0], N).tokens
    r = run_ar(model, prompts[0], N, stop_tokens=[full[5]])
    assert r.tokens == full[: full.index(full[5])]


def test_best_mlx_sd_sweeps_every_k(pair):
    model, draft, prompts = pair
    sweep = best_mlx_sd(model, draft, prompts, 8, ks=(2, 3), warmup=False)
    assert set(sweep.tokens_per_s) == {2, 3} and sweep.best_k in (2, 3)
    assert sweep.tokens_per_s[sweep.best_k] == max(sweep.tokens_per_s.values())
    assert all(len(rs) == len(prompts) for rs in sweep.runs.values())
