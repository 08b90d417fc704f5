"""The recycled draft (draft_model="recycle"): the target's own top candidates from earlier verifies, grown
into a token tree and verified in one forward (mirror_mlx/proposers/recycle.py, mirror_mlx/engine/tree.py).

A tree's forward gives each node what a plain forward over its path gives; the cache then holds the
committed path only. Every family returns mlx-lm's greedy tokens, with large trees (row_cost=0: every
node that the table fills) and the sized ones, alone and with the prompt lookup as the tree's first
branch; a recurrent family verifies one path, and says so. At T = 1 every committed token is a sample of
the target's processed distribution (the whole-generation chi-square of test_sampling_whole), and a
seeded sample is the same tokens as ar's.
"""

import mlx.core as mx
import numpy as np
import pytest

from mirror_mlx.engine import tree as trees
from mirror_mlx.engine.model_parts import trimmable_cache
from mirror_mlx.pipeline import Pipeline
from mirror_mlx.proposers.recycle import Recycled, verify_cost
from tests.models import CONFIGS, tiny_model
from tests.support import assert_lossless, FakeTokenizer, reference_greedy
from tests.support.whole_sampling import PROMPT as SMALL_PROMPT
from tests.support.whole_sampling import SHAPE, SEEDED_P, V, conditional_test, processed_probs, rows_in_step

VOCAB = CONFIGS["llama_tied"]["vocab_size"]
PROMPTS = [[7, 30], [5, 61, 2, 88, 13, 40], [90, 3, 3, 17, 52, 8, 71, 29, 64, 11, 6]]
TOKENS = 40
FAMILIES = ["gemma3_text", "llama_tied", "mistral", "qwen2", "qwen3"]  # gemma3: sliding windows of 4 tokens


def two_branches() -> trees.Tree:
    """root 7 → 3 → 11 and root 7 → 9 → 12 → 5 (a second branch, deeper than the first)."""
    return trees.build(7, [(0, 3, "r", None), (0, 9, "r", None), (1, 11, "r", None), (2, 12, "r", None),
                           (4, 5, "r", None)])


@pytest.mark.parametrize("family", ["llama_tied", "gemma3_text"])
def test_a_tree_forward_gives_each_node_what_its_path_gives(family):
    model, prompt = tiny_model(family, seed=21), PROMPTS[2]  # (past gemma3's window)
    tree = two_branches()
    assert [tree.tokens[i] for i in (0, 2, 4, 5)] == [7, 9, 12, 5] and tree.depths == [0, 1, 1, 2, 2, 3]
    cache = trimmable_cache(model)
    model(mx.array([prompt]), cache=cache)
    logits = trees.forward(model, cache, tree)
    for path in ([0, 1, 3], [0, 2, 4, 5]):
        plain = trimmable_cache(model)
        model(mx.array([prompt]), cache=plain)
        expect = model(mx.array([[tree.tokens[i] for i in path]]), cache=plain)[0]
        assert mx.allclose(logits[mx.array(path)], expect, atol=1e-4).item(), path


def test_keeping_a_path_leaves_the_cache_as_if_only_it_had_run():
    model, prompt = tiny_model("qwen3", seed=21), PROMPTS[1]
    tree = two_branches()
    cache = trimmable_cache(model)
    model(mx.array([prompt]), cache=cache)
    trees.forward(model, cache, tree)
    trees.keep_path(cache, len(prompt), [0, 2, 4])
    plain = trimmable_cache(model)
    model(mx.array([prompt + [7, 9, 12]]), cache=plain)
    assert cache[0].offset == plain[0].offset == len(prompt) + 3
    after, expect = (model(mx.array([[5]]), cache=c)[0] for c in (cache, plain))
    assert mx.allclose(after, expect, atol=1e-4).item()


def test_the_walk_descends_while_a_child_holds_the_target_token():
    tree = two_branches()
    logits = mx.full((len(tree), 16), -10.0)
    for node, best in ((0, 9), (2, 12), (4, 1)):  # root picks 9, then 12, then 1 (no child holds it)
        logits[node, best] = 10.0
    out = trees.walk(logits, tree, [7], lambda lp, first: [int(i) for i in mx.argmax(lp, axis=-1).tolist()], [])
    assert out.path == [2, 4] and out.tokens == [9, 12, 1] and out.logprobs.shape == (3, 16)


@pytest.fixture(scope="module")
def pipes():
    """A recycled-draft pipeline per family, made when first asked for (the last one open at a time)."""
    made: dict = {}

    def get(family: str):
        if family not in made:
            for old in made.values():
                old[-1].close()
            made.clear()
            target = tiny_model(family, seed=21)
            made[family] = ([reference_greedy(target, p, TOKENS) for p in PROMPTS],
                            Pipeline(target, FakeTokenizer(VOCAB), draftless="recycle"))
        return made[family]

    yield get
    for old in made.values():
        old[-1].close()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_recycled_tree_equals_mlx_lm_greedy_in_every_family(pipes, family):
    refs, pipe = pipes(family)
    trees_verified = 0
    for row_cost in (0.0, None):  # every node the table fills, then the trees that pay
        for lookup in (False, True):
            for prompt, ref in zip(PROMPTS, refs):
                out = pipe.generate(prompt, max_tokens=TOKENS, stop=False, row_cost=row_cost, lookup=lookup)
                assert_lossless(out.tokens, ref, (row_cost, lookup, prompt))
                s = out.stats
                assert s.mode == "sd" and s.recycle == "tree" and s.lookup == lookup
                assert lookup or s.lookup_proposed == 0
                trees_verified += s.proposed > s.steps  # more nodes than one a step: branches were verified
    assert trees_verified > 0


def test_the_table_lasts_the_pipeline_and_large_trees_accept_more(pipes):
    refs, pipe = pipes("llama_tied")
    first = pipe.generate(PROMPTS[0], max_tokens=TOKENS, stop=False, row_cost=0.0, lookup=False).stats
    again = pipe.generate(PROMPTS[0], max_tokens=TOKENS, stop=False, row_cost=0.0, lookup=False).stats
    assert again.accepted >= first.accepted and again.mean_accepted > 1.5
    assert "accepted: recycled" in again.summary()


def test_a_recurrent_target_verifies_one_path_and_says_so(capfd):
    target = tiny_model("qwen3_next", seed=21)
    pipe = Pipeline(target, FakeTokenizer(VOCAB), draftless="recycle")
    try:
        assert "takes no tree" in capfd.readouterr().err
        for prompt in PROMPTS:
            for row_cost in (0.0, None):
                out = pipe.generate(prompt, max_tokens=24, stop=False, row_cost=row_cost, lookup=True)
                assert_lossless(out.tokens, reference_greedy(target, prompt, 24))
                assert out.stats.recycle.startswith("one path: this qwen3_next model takes no tree")
            assert row_cost is None or out.stats.proposed > 0  # chains of rank-0 candidates were verified
    finally:
        pipe.close()


def test_the_shape_grows_with_cheaper_rows_and_pays_nothing_when_rows_are_dear():
    r, linear = Recycled(16), lambda c: verify_cost(c, None)
    small, large = r.shape(8, linear(0.2)), r.shape(8, linear(0.01))
    assert 0 < len(small) < len(large)
    assert r.shape(8, linear(5.0)) == []
    assert all(parent < s for s, (parent, _) in enumerate(large, start=1))  # a parent before its children
    assert max(len(large), 1) <= 64 and Recycled(16, one_path="why").shape(8, linear(0.0)) != []
    assert all(rank == 0 for _, rank in Recycled(16, one_path="why").shape(8, linear(0.0)))


def test_timed_widths_size_the_tree_where_no_row_cost_is_given():
    free_to_8 = verify_cost(None, {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 3.0})
    assert free_to_8(3) == 1.0 and free_to_8(7) == 1.0 and free_to_8(11) == 2.0 and free_to_8(31) == 7.0
    assert verify_cost(0.5, {1: 1.0, 2: 9.0})(2) == 2.0  # a row cost given wins
    r = Recycled(16)
    assert len(r.shape(8, free_to_8)) == 7  # the rows that cost nothing, no more: the next ones cost 0.25 each


def test_what_the_walks_saw_sets_the_shape():
    r = Recycled(16)
    tree = trees.build(1, [(0, 2, "recycle", None), (0, 3, "recycle", None)])
    tree.options = [[2, 3] + [-1] * 6, [4] + [-1] * 7, [5] + [-1] * 7]
    for _ in range(50):  # the target's token after the root was always the rank-1 candidate
        r.learn(tree, [2], [3, 9], np.zeros((3, 8), dtype=np.int32))
    p = r.p()
    assert p[0, 1] > 0.9 and p[0, 0] < 0.1


def test_a_recycled_draft_runs_in_sd_only():
    pipe = Pipeline(tiny_model("llama_tied", seed=21), FakeTokenizer(VOCAB), draftless="recycle")
    try:
        with pytest.raises(ValueError, match="needs a draft model.*the recycle draft runs in"):
            pipe.generate(PROMPTS[0], max_tokens=4, mode="mirror")
        assert pipe.generate(PROMPTS[0], max_tokens=4, mode="ar").stats.recycle == ""
    finally:
        pipe.close()


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_model("llama_tied", seed=11, **SHAPE)
    pipe = Pipeline(target, FakeTokenizer(V), draftless="recycle")
    yield target, pipe
    pipe.close()


def test_a_seeded_sample_through_trees_is_ar_s_sample(small_pair):
    target, pipe = small_pair
    for seed in range(4):
        ar = pipe.generate(SMALL_PROMPT, max_tokens=20, seed=seed, mode="ar", stop=False, temperature=1.0)
        tree = pipe.generate(SMALL_PROMPT, max_tokens=20, seed=seed, stop=False, temperature=1.0, row_cost=0.0,
                             lookup=False)
        assert_lossless(tree.tokens, ar.tokens)
        assert tree.stats.accepted > 0


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.8, repetition_penalty=1.5, top_k=5)],
                         ids=["temperature", "processed"])
def test_every_token_a_tree_commits_is_a_sample_of_the_target(small_pair, settings):
    target, pipe = small_pair
    outputs, rows, accepted = [], [], 0
    for seed in range(40):
        chunks = list(pipe.stream(SMALL_PROMPT, max_tokens=20, seed=seed, stop=False, row_cost=0.0, lookup=False,
                                  **settings))
        outputs.append([t for c in chunks for t in c.tokens])
        rows.append(rows_in_step([d for c in chunks for d in c.from_draft]))
        accepted += pipe.stats.accepted
    outputs, rows = np.array(outputs), np.array(rows)
    probs = processed_probs(target, outputs, **settings)
    previous = np.concatenate([np.full((len(outputs), 1), SMALL_PROMPT[-1]), outputs[:, :-1]], axis=1)
    p = conditional_test(outputs.reshape(-1), probs.reshape(-1, V), rows.reshape(-1), previous.reshape(-1))
    assert accepted > 100  # trees were accepted deep, often
    assert min(p.values()) > SEEDED_P, p
