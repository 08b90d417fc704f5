"""Seeded sampling is mode-invariant: the draw for absolute position p is keyed by (seed, p).

ar samples one row per forward, sd and mirror several; with the same seed all three (and sd with the
prompt lookup, alone or beside the draft) commit the same tokens, under every sampling setting mlx-lm has (the distribution itself is checked by the
chi-square tests in test_sampling.py).
"""

import pytest

import mirror_mlx
from tests.support import assert_lossless

SETTINGS = {
    "temperature": dict(temperature=0.9),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "top_k": dict(temperature=1.2, top_k=5),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "repetition_penalty": dict(temperature=0.8, repetition_penalty=1.3),
    "all": dict(temperature=1.1, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1),
}


@pytest.fixture(scope="module")
def lookup_pipe():
    p = mirror_mlx.load(draft_model="lookup")
    yield p
    p.close()


@pytest.mark.parametrize("name", SETTINGS)
def test_same_seed_same_tokens_in_every_mode(pipe, lookup_pipe, name):
    kw = dict(SETTINGS[name], max_tokens=24, seed=3, stop=False)
    ar = pipe.generate("Once upon a time", mode="ar", **kw).tokens
    assert len(ar) == 24
    for mode, branches in (("sd", None), ("mirror", None), ("mirror", 2), ("mirror", 5)):  # B: a branch budget
        out = pipe.generate("Once upon a time", mode=mode, kappa=4, gamma=5, branches=branches, **kw)
        assert_lossless(out.tokens, ar, mode, branches)
    again = "The dog ran to the park. The dog ran to the"  # repeats itself: the lookup proposes from the start
    ar = pipe.generate(again, mode="ar", **kw).tokens
    lookup = [pipe.generate(again, mode="sd", gamma=5, lookup=True, **kw),
              pipe.generate(again, mode="mirror", kappa=4, gamma=5, lookup=True, **kw),
              lookup_pipe.generate(again, mode="sd", gamma=5, **kw)]
    for out, name in zip(lookup, ("beside the draft", "in mirror", "alone")):
        assert_lossless(out.tokens, ar, f"lookup {name}")
        assert out.stats.lookup_windows > 0, f"lookup {name}: never proposed"


def test_another_seed_gives_another_sample(pipe):
    kw = dict(max_tokens=40, temperature=1.0, mode="mirror", stop=False)
    assert pipe.generate("Once upon a time", seed=3, **kw).tokens != pipe.generate("Once upon a time", seed=4, **kw).tokens
