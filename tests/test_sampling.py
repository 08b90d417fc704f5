"""Temperature > 0: every committed token is a sample of the target's own processed distribution.

A target with an 8-token vocabulary makes the exact distribution of the first two generated
tokens computable: P(a, b) = p(a | prompt) · p(b | prompt, a), with mlx-lm's own top-p filter.
Thousands of seeded runs per mode must match it (chi-square); a biased verifier would not.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_top_p
from scipy.stats import chisquare

from mirror_mlx.drafts.recipes import DraftRecipe, mlx_draft
from mirror_mlx.pipeline import Pipeline
from tests.models import save_tiny_model, tiny_model
from tests.support import FakeTokenizer

V = 8
PROMPT = [3, 1, 4]
RUNS = 2000


def processed_probs(model, tokens, temperature, top_p):
    logits = model(mx.array([tokens]))[0, -1]
    logprobs = logits - mx.logsumexp(logits)
    if top_p < 1.0:
        logprobs = apply_top_p(logprobs[None], top_p)[0]
    return np.array(mx.softmax(logprobs / temperature), dtype=np.float64)


def exact_pair_probs(model, temperature, top_p):
    p1 = processed_probs(model, PROMPT, temperature, top_p)
    return np.array([[p1[a] * processed_probs(model, PROMPT + [a], temperature, top_p)[b] for b in range(V)]
                     for a in range(V)])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The draft runs in its own host process, as `load` runs it."""
    target = tiny_model("llama_tied", seed=11, vocab_size=V, hidden_size=32, num_attention_heads=2,
                        num_key_value_heads=2, head_dim=16, num_hidden_layers=4)
    draft = save_tiny_model(tmp_path_factory.mktemp("draft"), "llama_tied", seed=12, vocab_size=V, hidden_size=32,
                            num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_hidden_layers=2)
    pipe = Pipeline(target, FakeTokenizer(V), DraftRecipe(mlx_draft, (str(draft),)))
    assert pipe.engine.host.process
    yield target, pipe
    pipe.close()


@pytest.mark.parametrize("mode,top_p", [("mirror", 0.9), ("sd", 1.0)])
def test_first_two_tokens_follow_the_target_distribution(pair, mode, top_p):
    """Each mode once, each top-p once: tests/test_sampling_whole.py checks mirror under each filter and sd under
    all of them at once."""
    target, pipe = pair
    expected = exact_pair_probs(target, 1.0, top_p).ravel()
    counts = np.zeros(V * V)
    for seed in range(RUNS):
        out = pipe.generate(PROMPT, max_tokens=2, temperature=1.0, top_p=top_p, seed=seed, mode=mode,
                            kappa=2, gamma=3, exit_layer=2, stop=False)
        counts[out.tokens[0] * V + out.tokens[1]] += 1
    assert counts[expected == 0].sum() == 0, "a token outside the top-p nucleus was committed"
    f_exp = expected * RUNS
    big = f_exp >= 5  # chi-square needs expected counts >= 5: pool the rare cells
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(f_exp[big], f_exp[~big].sum())
    keep = exp > 0
    p_value = chisquare(obs[keep], exp[keep] * obs.sum() / exp[keep].sum()).pvalue
    assert p_value > 0.001, f"{mode} top_p={top_p}: committed pairs do not follow the target (p={p_value:.2g})"


def test_the_check_catches_a_biased_sampler(pair):
    """The same statistic rejects draws from the wrong distribution (the test can fail)."""
    target, _ = pair
    expected = exact_pair_probs(target, 1.0, 1.0).ravel()
    wrong = exact_pair_probs(target, 0.7, 1.0).ravel()  # a verifier that sampled at the wrong temperature
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.choice(V * V, size=RUNS, p=wrong / wrong.sum()), minlength=V * V)
    big = expected * RUNS >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum()) * RUNS
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue < 0.001
