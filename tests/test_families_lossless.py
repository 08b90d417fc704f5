"""Greedy losslessness end to end in every family the early exit supports: mirror and sd return
token for token what mlx-lm's own greedy generation of the same target returns.

Tiny random targets of each family (tests/models.py CONFIGS: llama with a tied head, mistral (mlx-lm
runs it as llama, here with its own head), qwen2, qwen3, gemma3 with sliding-window layers) decode a
few prompts, the longest past gemma3's sliding window. Two drafts per family, each in its own host
process: the target itself (every window accepted whole: bonus tokens, reuse of the bonus row's
branches, and γ = 6 windows) and a random model of the same family with half its layers (windows
rejected early: fallbacks). The prompt lookup (mirror_mlx/proposers/lookup.py) decodes the same prompts and a
prompt that repeats itself, alone and beside the random draft, and one with no repeat (no proposal).
"""

import pytest

from mirror_mlx.drafts.recipes import DraftRecipe, mlx_draft
from mirror_mlx.drafts.mlx_draft import MLXDraft
from mirror_mlx.pipeline import Pipeline
from tests.models import CACHE_FAMILIES, CONFIGS, RECURRENT, save_tiny_model, tiny_model
from tests.support import assert_lossless, FakeTokenizer, reference_greedy

TOKENS = 24
VOCAB = CONFIGS["llama_tied"]["vocab_size"]
PROMPTS = [[7, 30], [5, 61, 2, 88, 13, 40], [90, 3, 3, 17, 52, 8, 71, 29, 64, 11, 6]]
KNOBS = {  # (κ, γ, ℓe[, B]) per draft: the random draft's windows are rejected early, long ones add nothing
    "self": [(1, 1, 3), (3, 4, 2), (8, 6, 1), (4, 3, 2, 5)],
    "random": [(1, 1, 3), (3, 4, 2), (4, 3, 2, 2)],
}
CASES = [(family, draft, knobs) for family in CACHE_FAMILIES for draft in KNOBS for knobs in KNOBS[draft]]


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    """One pipeline per family and draft, shared by its knob settings (the last one open at a time)."""
    made: dict = {}

    def get(family: str, draft: str):
        if (family, draft) not in made:
            for old in made.values():
                old[-1].close()
            made.clear()
            made[family, draft] = build(family, draft, tmp_path_factory)
        return made[family, draft]

    yield get
    for old in made.values():
        old[-1].close()


def build(family: str, draft: str, tmp_path_factory):
    """mlx-lm's greedy references and a pipeline, for one family and draft."""
    target = tiny_model(family, seed=21)
    folder = tmp_path_factory.mktemp(f"{family}-{draft}")
    if draft == "self":
        save_tiny_model(folder, family, seed=21)
    else:
        save_tiny_model(folder, family, seed=22, num_hidden_layers=CONFIGS[family]["num_hidden_layers"] // 2)
    refs = [reference_greedy(target, p, TOKENS) for p in PROMPTS]
    pipe = Pipeline(target, FakeTokenizer(VOCAB), DraftRecipe(mlx_draft, (str(folder),)))
    assert pipe.engine.host.process
    return refs, pipe


@pytest.mark.parametrize("family,draft,knobs", CASES, ids=[f"{f}-{d}-k{k[0]}g{k[1]}e{k[2]}" + (f"B{k[3]}" if len(k) > 3 else "") for f, d, k in CASES])
def test_mirror_and_sd_equal_mlx_lm_greedy_in_every_family(pipelines, family, draft, knobs):
    kappa, gamma, exit_layer, branches = (*knobs, None)[:4]
    refs, pipe = pipelines(family, draft)
    for mode in ("mirror", "sd") if branches is None else ("mirror",):  # (a budget changes mirror only)
        accepted = proposed = reuses = fallbacks = 0
        for prompt, ref in zip(PROMPTS, refs):
            # (no B: every branch, so which are rolled out does not hang on the machine's timings)
            every = kappa * (gamma + 1) if mode == "mirror" and branches is None else branches
            out = pipe.generate(prompt, max_tokens=TOKENS, mode=mode, kappa=kappa, gamma=gamma,
                                exit_layer=exit_layer, branches=every, stop=False)
            assert out.stats.mode == mode and out.stats.draft_failure is None
            assert_lossless(out.tokens, ref, f"{family}, {draft} draft, {mode} κ={kappa} γ={gamma} "
                                             f"ℓe={exit_layer}: prompt {prompt} gave {out.tokens}, mlx-lm {ref}")
            accepted, proposed = accepted + out.stats.accepted, proposed + out.stats.proposed
            reuses, fallbacks = reuses + out.stats.reuses, fallbacks + out.stats.fallbacks
        if draft == "self":  # the draft's greedy windows are the target's own: every path of a step ran
            assert accepted >= 0.9 * proposed, f"{family} {mode}: the target as draft got {accepted}/{proposed}"
        if mode == "mirror":
            assert reuses > 0 and (fallbacks > 0 or draft == "self"), (family, draft, reuses, fallbacks)


def test_a_one_token_prompt_keeps_the_draft():
    """A one-token prompt leaves the draft nothing to prefill; its windows still come, from the pending token."""
    target = tiny_model("llama_tied", seed=21)
    pipe = Pipeline(target, FakeTokenizer(VOCAB), MLXDraft(tiny_model("llama_tied", seed=21)))
    try:
        for mode in ("mirror", "sd"):
            out = pipe.generate([7], max_tokens=8, mode=mode, stop=False)
            # lossless either way (ar after a dropped draft)
            assert_lossless(out.tokens, reference_greedy(target, [7], 8))
            assert out.stats.draft_failure is None and out.stats.mode == mode, out.stats.draft_failure
    finally:
        pipe.close()


# --- families with recurrent state (tests/models.py RECURRENT) ----------------------------------------------

OPENINGS = [[7, 30], [5, 61, 2, 88, 13, 40], [90, 3, 3, 17, 52, 8, 71, 29, 64, 11, 6], [1], [44, 44, 44],
            [12, 80, 33, 2], [60, 9, 27, 95, 14, 3, 70, 41], [19, 2, 55, 55, 8, 66, 23, 31, 4, 90, 77, 12, 5, 38]]
R_TOKENS = 12
R_KNOBS = [(1, 1, 3), (3, 4, 2), (8, 6, 1)]


def recurrent_draft(family: str):
    """A draft with recurrent state too: the family's first half (same seed, so windows are partly accepted:
    rollbacks at every depth)."""
    if family == "qwen3_5":
        return tiny_model(family, seed=21, text_config=dict(RECURRENT[family]["text_config"], num_hidden_layers=2))
    if family == "nemotron_h":
        return tiny_model(family, seed=21, hybrid_override_pattern=list("M*M"))
    if family == "lfm2":
        return tiny_model(family, seed=21, num_hidden_layers=2, layer_types=["conv", "full_attention"])
    return tiny_model(family, seed=21, num_hidden_layers=RECURRENT[family]["num_hidden_layers"] // 2)


@pytest.fixture(scope="module")
def recurrent_pipes():
    made: dict = {}

    def get(family: str):
        if family not in made:
            for old in made.values():
                old[-1].close()
            made.clear()
            target = tiny_model(family, seed=21)
            refs = [reference_greedy(target, p, R_TOKENS) for p in OPENINGS]
            made[family] = (target, refs, Pipeline(target, FakeTokenizer(VOCAB), MLXDraft(recurrent_draft(family))))
        return made[family]

    yield get
    for old in made.values():
        old[-1].close()


R_CASES = [(family, knobs) for family in RECURRENT for knobs in R_KNOBS]


@pytest.mark.parametrize("family,knobs", R_CASES, ids=[f"{f}-k{k}g{g}e{e}" for f, (k, g, e) in R_CASES])
def test_recurrent_families_equal_mlx_lm_greedy_in_every_mode(recurrent_pipes, family, knobs):
    """ar (prefix reuse across openings), sd and mirror roll the target's and the draft's recurrent state back
    to exactly the accepted tokens: token for token mlx-lm's greedy generation."""
    kappa, gamma, exit_layer = knobs
    _, refs, pipe = recurrent_pipes(family)
    for mode in ("ar", "sd", "mirror"):
        accepted = proposed = 0
        for prompt, ref in zip(OPENINGS, refs):
            out = pipe.generate(prompt, max_tokens=R_TOKENS, mode=mode, kappa=kappa, gamma=gamma,
                                exit_layer=exit_layer, stop=False)
            assert out.stats.mode == mode and out.stats.draft_failure is None, out.stats.draft_failure
            assert_lossless(out.tokens, ref, f"{family} {mode} κ={kappa} γ={gamma} ℓe={exit_layer}: "
                                             f"prompt {prompt} gave {out.tokens}, mlx-lm {ref}")
            accepted, proposed = accepted + out.stats.accepted, proposed + out.stats.proposed
        if mode != "ar" and gamma > 1 and family != "nemotron_h":  # windows cut inside: rollbacks at depths 1..γ-1
            # (nemotron_h's half draft draws its own head, so its windows are rejected at the first token)
            assert 0 < accepted < proposed, (family, mode, accepted, proposed)


@pytest.mark.parametrize("family", list(RECURRENT))
def test_recurrent_families_seeded_sample_is_mode_invariant(recurrent_pipes, family):
    _, _, pipe = recurrent_pipes(family)
    kw = dict(max_tokens=R_TOKENS, temperature=0.8, seed=3, stop=False, kappa=3, gamma=4, exit_layer=2)
    ar = pipe.generate(OPENINGS[1], mode="ar", **kw).tokens
    for mode in ("sd", "mirror"):
        assert_lossless(pipe.generate(OPENINGS[1], mode=mode, **kw).tokens, ar, family, mode)


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2"])
def test_a_conversation_in_a_prompt_cache_equals_a_fresh_run(recurrent_pipes, family):
    """Three turns through one prompt cache (mlx-lm's make_prompt_cache list: its ArraysCache layers become
    droppable in place): each reply is what a fresh run of the whole conversation gives."""
    from mlx_lm.models.cache import make_prompt_cache

    from mirror_mlx.prompt_cache import PromptCache

    target, _, pipe = recurrent_pipes(family)
    cache = PromptCache(make_prompt_cache(target), [], {}, origin="list")
    history: list[int] = []
    for turn in ([5, 61, 2], [88, 13], [40, 7, 30]):
        history += turn
        out = pipe.generate(turn, prompt_cache=cache, max_tokens=R_TOKENS, mode="mirror", kappa=3, gamma=4,
                            exit_layer=2, stop=False)
        assert_lossless(out.tokens, reference_greedy(target, history, R_TOKENS), (family, history))
        history += out.tokens
        cache.tokens = list(history)
        assert cache.length == len(history)


def test_the_prefix_cache_reuses_a_stored_recurrent_state_as_an_exact_prefix_only(recurrent_pipes):
    """The server's prefix cache across requests: a stored recurrent state is exact at its point and cannot be
    cut back, so it serves a prompt that extends it (the output is a fresh run's), and not one that leaves it."""
    from mirror_mlx.server.prefix_cache import PrefixCache

    target, _, pipe = recurrent_pipes("qwen3_next")
    prefix = PrefixCache(pipe.engine, size=4)
    kw = dict(max_tokens=R_TOKENS, mode="mirror", kappa=3, gamma=4, exit_layer=2, stop=False)

    def request(ids):
        held = prefix.restore(ids)
        out = pipe.generate(ids, **kw)
        assert_lossless(out.tokens, reference_greedy(target, ids, R_TOKENS), ids)
        prefix.store()
        return held, out.tokens

    first = OPENINGS[7]
    _, reply = request(first)
    request(OPENINGS[2])  # another conversation: the engine's own cache now holds it
    assert request(first[:-3] + [1, 2])[0] == 0  # leaves the stored point: no reuse (prefilled again)
    held, _ = request(first + reply + [4, 5])  # extends it: starts from the stored state
    assert held == len(first) + len(reply) - 1  # (the stored cache holds the committed tokens but the last)


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2"])
def test_a_prompt_cache_file_of_a_recurrent_target_serves_every_mode(recurrent_pipes, family, tmp_path):
    """`mirror-mlx cache-prompt`'s file (mlx-lm's format: plain ArraysCache layers, plus the ids) read back
    droppable: ar and mirror continue it as a fresh run of the whole prompt."""
    from mirror_mlx import prompt_cache

    target, _, pipe = recurrent_pipes(family)
    path, ids, rest = str(tmp_path / "cache.safetensors"), OPENINGS[1], [7, 30]
    prompt_cache.write(path, target, ids, {})
    for mode in ("ar", "mirror"):
        cache = prompt_cache.read(path)
        out = pipe.generate(rest, prompt_cache=cache, max_tokens=R_TOKENS, mode=mode, kappa=3, gamma=4,
                            exit_layer=2, stop=False)
        assert_lossless(out.tokens, reference_greedy(target, ids + rest, R_TOKENS), (family, mode))
        assert cache.length == len(ids) + len(rest) + R_TOKENS


LOOKUP_PROMPTS = PROMPTS + [[5, 61, 2, 88, 13, 40, 9, 5, 61, 2, 88, 13, 40, 9, 5, 61]]  # the last repeats itself


@pytest.mark.parametrize("family", CACHE_FAMILIES)
def test_the_lookup_alone_and_beside_a_draft_equals_mlx_lm_greedy(pipelines, family):
    """sd with the lookup alone (no draft model: no host), and sd and mirror with it beside the random draft,
    return mlx-lm's greedy tokens; its proposals were both accepted and rejected, and the draft still drafted
    where it had none."""
    refs, pipe = pipelines(family, "random")
    refs = refs + [reference_greedy(pipe.model, LOOKUP_PROMPTS[-1], TOKENS)]
    alone = Pipeline(pipe.model, FakeTokenizer(VOCAB), draftless="lookup")
    beside = dict(lookup=True, ngram_min=1)
    try:
        assert alone.engine.host is None
        for p, kw, name in ((alone, dict(mode="sd"), "alone"), (pipe, dict(beside, mode="sd"), "beside the draft"),
                            (pipe, dict(beside, mode="mirror", kappa=1, exit_layer=2), "in mirror")):
            total = None
            cases = list(zip(LOOKUP_PROMPTS, refs))
            for prompt, ref in cases[-2:] if name == "in mirror" else cases:  # (mirror: the longest two, cheaper)
                out = p.generate(prompt, max_tokens=TOKENS, gamma=4, stop=False, **kw)
                assert_lossless(out.tokens, ref,
                                f"{family}, lookup {name}: prompt {prompt} gave {out.tokens}, mlx-lm {ref}")
                assert out.stats.lookup and out.stats.draft_failure is None
                total = out.stats if total is None else total + out.stats
            if name == "in mirror":  # (its lookup fills only the windows after a fallback: both paths in test_lookup.py)
                assert total.lookup_windows > 0 and total.fallbacks > 0, (family, name, total.summary())
            else:
                assert total.lookup_accepted > 0 and total.lookup_rejections > 0, (family, name, total.summary())
            if p is pipe:
                assert total.proposed > total.lookup_proposed and total.rollouts > 0, total.summary()
            else:
                assert total.rollouts == 0 and total.proposed == total.lookup_proposed
    finally:
        alone.close()


def test_no_repeat_no_proposal():
    """A context with no repeated n-gram gives the lookup nothing: every step is the target's alone (ar)."""
    import mirror_mlx

    pipe = mirror_mlx.load(draft_model="lookup")  # the demo target: its stories do not loop like a random model
    try:
        prompt, n = pipe.encode("Once upon a time"), 10
        ref = reference_greedy(pipe.model, prompt, n)
        text = prompt + ref[:-1]  # (the last token is never looked up from)
        assert len(set(zip(text, text[1:]))) == len(text) - 1, "the demo target repeats a bigram here"
        out = pipe.generate(prompt, max_tokens=n, mode="sd", ngram_min=2, stop=False)
        assert_lossless(out.tokens, ref)
        assert out.stats.lookup and out.stats.lookup_proposed == 0 and out.stats.target_forwards == n
    finally:
        pipe.close()
